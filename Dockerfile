# The image cluster.yaml runs on every node: this project installed, CUDA torch, DeepSpeed's
# CUDA ops compiled at build time (no JIT on 992 GPUs at start-up), EFA's libfabric and the
# aws-ofi-nccl plugin so NCCL uses EFA. Build and push:
#   docker build -t <account>.dkr.ecr.<region>.amazonaws.com/opt-pipeline:latest . && docker push ...
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        software-properties-common curl git openssh-client rsync sudo build-essential \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/*

# EFA: libfabric + the NCCL plugin (the installer skips the kernel module inside a container).
RUN curl -sL https://efa-installer.amazonaws.com/aws-efa-installer-latest.tar.gz | tar xz -C /tmp \
    && cd /tmp/aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
    && rm -rf /tmp/aws-efa-installer
ENV FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 NCCL_PROTO=simple LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:$LD_LIBRARY_PATH
# NCCL's start-up log (which network it chose) into a file per process: the training loop checks there that
# NCCL selected the EFA provider (train/plan/network.py) instead of falling back to TCP sockets at a tenth the speed.
ENV NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip && pip install torch   # the CUDA build

WORKDIR /opt/opt-pipeline
COPY pyproject.toml README.md ./
COPY core core
COPY pipelines pipelines
COPY corpus corpus
COPY dedup dedup
COPY screen screen
COPY model model
COPY train train
COPY configs configs
# DeepSpeed's fused Adam and utils compiled for A100 (sm_80) and H100/H200 (sm_90).
RUN TORCH_CUDA_ARCH_LIST="8.0;9.0" DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_CPU_ADAM=1 \
    pip install -e . && ds_report
