"""cluster.yaml against Ray's own autoscaler schema, as `ray up` checks it (without launching)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from conftest import ROOT


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def schema():
    return json.loads(Path(ray.autoscaler.__file__).with_name("ray-schema.json").read_text())


def test_cluster_yaml_passes_rays_schema_raw_and_with_defaults(cluster, schema):
    jsonschema.validate(cluster, schema)
    validate_config(prepare_config(copy.deepcopy(cluster)))  # what `ray up` does before launching


def test_schema_catches_a_misspelt_key(cluster, schema):
    bad = copy.deepcopy(cluster)
    bad["available_node_types"]["p4de"]["max_wrkers"] = 1
    with pytest.raises(jsonschema.ValidationError, match="max_wrkers"):
        jsonschema.validate(bad, schema)


def test_the_opt_175b_cluster(cluster):
    worker = cluster["available_node_types"]["p4de"]
    assert worker["node_config"]["InstanceType"] == "p4de.24xlarge"
    assert worker["max_workers"] == cluster["max_workers"] == 124  # 124 x 8 A100 = 992 GPUs
    assert {n["InterfaceType"] for n in worker["node_config"]["NetworkInterfaces"]} == {"efa"}
    assert cluster["provider"]["type"] == "aws" and cluster["docker"]["image"].endswith("opt-pipeline:latest")
    assert any("/fsx" in c for c in cluster["initialization_commands"])
    head = " ".join(cluster["head_start_ray_commands"])
    assert "mlflow server" in head and "--host 0.0.0.0" not in head and "--dashboard-host=127.0.0.1" in head
    text = (ROOT / "cluster.yaml").read_text().lower()
    assert "aws_secret_access_key" not in text and "aws_access_key_id" not in text
    assert (ROOT / "Dockerfile").is_file()


def test_the_image_holds_every_package_the_project_installs():
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    missing = [p.rstrip("*") for p in packages if p.rstrip("*") not in copied]
    assert not missing, f"Dockerfile does not COPY {missing}: `pip install -e .` in the image would miss them"


def test_the_nodes_run_a_pinned_current_dlami_and_efa_has_what_aws_documents(cluster):
    for node_type in cluster["available_node_types"].values():
        assert node_type["node_config"]["ImageId"].startswith("ami-")  # pinned; Ray's latest_dlami is Ubuntu 18.04's
    text = (ROOT / "cluster.yaml").read_text()
    assert "latest_dlami" not in text.replace("Ray's `latest_dlami`", "")
    assert "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id" in text
    options = cluster["docker"]["run_options"]
    assert "--ulimit memlock=-1:-1" in options and "--device=/dev/infiniband" in options
    image = (ROOT / "Dockerfile").read_text()
    assert "FI_PROVIDER=efa" in image and "NCCL_DEBUG=INFO" in image and "NCCL_DEBUG_FILE=" in image


EFA_LOG = """ip-10-0-1-23:812:851 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2
ip-10-0-1-23:812:851 [0] NCCL INFO NET/OFI Selected Provider is efa, fabric is efa-direct (found 4 nics)
ip-10-0-1-23:812:851 [0] NCCL INFO Using network Libfabric
"""
SOCKET_LOG = """ip-10-0-1-23:812:851 [0] NCCL INFO NET/OFI No eligible providers were found
ip-10-0-1-23:812:851 [0] NCCL INFO NET/IB : No device found.
ip-10-0-1-23:812:851 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.1.23<0>
ip-10-0-1-23:812:851 [0] NCCL INFO Using network Socket
"""


def test_the_training_start_fails_when_nccl_is_not_on_efa(tmp_path):
    from train.plan.network import debug_file, efa_problem, nccl_choice

    assert nccl_choice(EFA_LOG) == ("efa", "Libfabric") and nccl_choice(SOCKET_LOG) == (None, "Socket")
    pattern = str(tmp_path / "nccl.%h.%p.log")
    env = {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": pattern}
    debug_file(pattern).write_text(EFA_LOG)
    assert efa_problem(env) is None
    debug_file(pattern).write_text(EFA_LOG.replace("Selected Provider is efa,", "Selected Provider is efa-direct"))
    assert nccl_choice(debug_file(pattern).read_text())[0] == "efa-direct" and efa_problem(env) is None
    debug_file(pattern).write_text(EFA_LOG.replace("Selected Provider is efa,", "Selected Provider is tcp,"))
    assert "libfabric provider tcp" in efa_problem(env)
    debug_file(pattern).write_text(SOCKET_LOG)
    problem = efa_problem(env)
    assert problem.startswith("NCCL is not using EFA") and "provider none, network Socket" in problem
    assert efa_problem(env, spans_nodes=False) is None  # one node: NVLink, no network to check
    assert efa_problem({**env, "FI_PROVIDER": "tcp"}) is None  # EFA not meant here
    assert "NCCL's log is off" in efa_problem({"FI_PROVIDER": "efa"})
