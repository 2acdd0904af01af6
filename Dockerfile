# The image cluster.yaml runs on every node: this project installed, CUDA torch, DeepSpeed's
# CUDA ops compiled at build time (no JIT on 992 GPUs at start-up), EFA's libfabric and the
# aws-ofi-nccl plugin so NCCL uses EFA. Build and push, then write the digest the push prints into cluster.yaml
# (docker.image: ...opt-pipeline@sha256:<digest>):
#   docker build -t <account>.dkr.ecr.<region>.amazonaws.com/opt-pipeline:$(git rev-parse --short HEAD) . && docker push ...
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        software-properties-common curl git openssh-client rsync sudo build-essential \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/*

# EFA: libfabric + the NCCL plugin (the installer skips the kernel module inside a container). A pinned release,
# checked against its SHA-256 before it is unpacked, so that nothing but that release runs as root here; AWS lists
# each release's SHA-256 (docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-verify.html).
ARG EFA_INSTALLER_VERSION=1.41.0
ARG EFA_INSTALLER_SHA256=3506354cdfbe31ff552fe75f5d0d9bb7efd29cf79bd99457347d29c751c38f9f
RUN cd /tmp && curl -fsSLO https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
    && echo "${EFA_INSTALLER_SHA256}  aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | sha256sum -c - \
    && tar xzf aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
    && cd aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
    && rm -rf /tmp/aws-efa-installer /tmp/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz
ENV FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 NCCL_PROTO=simple LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:$LD_LIBRARY_PATH
# NCCL's start-up log (which network it chose) into a file per process: the training loop checks there that
# NCCL selected the EFA provider (train/plan/network.py) instead of falling back to TCP sockets at a tenth the speed.
ENV NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch pinned: the version the CPU suite runs (Makefile), its build for CUDA 12.8, the base image's CUDA, whose
# nvcc compiles DeepSpeed's ops below (torch's CUDA and nvcc's must agree).
RUN pip install --upgrade pip && pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128

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
# DeepSpeed's fused Adam and utils compiled for A100 (sm_80) and H100/H200 (sm_90); mlflow[auth] for the
# basic-auth app the head's MLflow server runs (Flask-WTF). Ray pinned to the version the bastion's `ray up` and
# `ray job submit` run (docs/cluster.md installs the same; tests/test_cluster.py holds them equal).
RUN TORCH_CUDA_ARCH_LIST="8.0;9.0" DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_CPU_ADAM=1 \
    pip install -e . "mlflow[auth]" "ray[data,train,default]==2.60.0" && ds_report
