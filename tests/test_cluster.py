"""cluster.yaml against Ray's own autoscaler schema, as `ray up` checks it (without launching), and the cluster's
security (its network, Ray's token, MLflow's login, the pinned image) against the real files."""

from __future__ import annotations

import configparser
import copy
import json
import re
import shlex
import subprocess
import sys
import time
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
    assert cluster["provider"]["type"] == "aws" and "/opt-pipeline@sha256:" in cluster["docker"]["image"]
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


def test_every_host_logs_in_to_the_images_registry_before_the_pull(cluster):
    """Ray runs a plain `docker pull` on each host: a private registry (ECR) refuses it without a login, so the host
    logs in first, to the registry the image names."""
    registry = cluster["docker"]["image"].split("/", 1)[0]
    logins = [c for c in cluster["initialization_commands"] if "docker login" in c]
    assert logins and registry in logins[0] and "--password-stdin" in logins[0]


def test_the_image_runs_the_ray_the_bastion_launches_with():
    """`ray up` and `ray job submit` on the bastion speak to the cluster's Ray: the image pins the version
    docs/cluster.md installs on the bastion, and the project allows it."""
    image = re.search(r'"ray\[[^\]]*\]==([\d.]+)"', (ROOT / "Dockerfile").read_text())
    bastion = re.search(r'"ray\[default\]==([\d.]+)"', (ROOT / "docs" / "cluster.md").read_text())
    floor = re.search(r'"ray\[[^\]]*\]>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert image and bastion and floor and image[1] == bastion[1] == floor[1]


def test_the_image_is_pinned_by_digest_never_by_tag(cluster):
    """Every node runs the image `ray up` was given, byte for byte: a digest (a placeholder until the image is
    pushed, which docker refuses to pull), never a tag such as :latest that a later push moves."""
    image = cluster["docker"]["image"]
    assert re.fullmatch(r"[\w.-]+(/[\w.-]+)+@sha256:([0-9a-f]{64}|REPLACE_ME)", image), image
    assert ":latest" not in (ROOT / "cluster.yaml").read_text()
    assert not any(k in cluster["docker"] for k in ("head_image", "worker_image"))


def test_every_node_is_in_the_cluster_group_and_ssh_comes_only_from_the_bastion(cluster):
    """Ray creates a security group for a node type that names none, with SSH open to 0.0.0.0/0
    (autoscaler/_private/aws/config.py): every node names ours, in SecurityGroupIds or, as Ray reads them, in each of
    its NetworkInterfaces. The group's rules, written out in docs/cluster.md: all traffic from the group itself, SSH
    only from the bastion's group, no CIDR."""
    for name, node in cluster["available_node_types"].items():
        config = node["node_config"]
        groups = config.get("SecurityGroupIds") or [g for nic in config["NetworkInterfaces"] for g in nic["Groups"]]
        assert set(groups) == {"sg-REPLACE_ME"}, name
    assert "security_group" not in cluster["provider"]
    rules = [shlex.split(line) for line in (ROOT / "docs" / "cluster.md").read_text().splitlines()
             if line.startswith("aws ec2 authorize-security-group-ingress")]
    assert rules and not any("--cidr" in r or "0.0.0.0/0" in " ".join(r) for r in rules)
    pairs = {(r[r.index("--protocol") + 1], r[r.index("--port") + 1] if "--port" in r else "all",
              r[r.index("--source-group") + 1]) for r in rules}
    assert pairs == {("all", "all", "sg-REPLACE_ME"), ("tcp", "22", "sg-REPLACE_ME_BASTION")}


def test_the_training_groups_ports_are_open_to_the_group_alone():
    """torch.distributed's store, gloo and NCCL have no login, and torch's object collectives unpickle what a peer
    sends: docs/cluster.md's port table lists their ports, guarded by the group only, and the group's rules (as
    written there) admit nothing else to them: the one rule from outside the group, the bastion's, names port 22,
    outside every training port. Ray Train's MASTER_PORT is the kernel's pick, in the range the table names."""
    from ray.train._internal.utils import get_address_and_port

    text = (ROOT / "docs" / "cluster.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    training = [r for r in rows if re.search(r"torch\.distributed's store|gloo's|NCCL's", r[1])]
    assert len(training) == 4 and all(r[3] == "nothing: the group only" for r in training)
    ranges = [(int(a), int(b)) for r in training for a, b in re.findall(r"(\d+)-(\d+)", r[0])]
    assert ranges and set(ranges) == {(32768, 60999)}
    rules = [shlex.split(line) for line in text.splitlines()
             if line.startswith("aws ec2 authorize-security-group-ingress")]
    outside = [r for r in rules if r[r.index("--source-group") + 1] != "sg-REPLACE_ME"]
    assert [(r[r.index("--protocol") + 1], r[r.index("--port") + 1]) for r in outside] == [("tcp", "22")]
    assert not any(low <= 22 <= high for low, high in ranges)
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert low <= get_address_and_port()[1] <= high


def test_the_head_stops_at_start_without_an_mlflow_password(cluster, tmp_path):
    """The head's start-up line as cluster.yaml has it, run by bash with stand-ins that record their calls: when
    core/tracking.py's admin_password() fails (no password in ~/.mlflow/credentials; tests/test_config.py tests it),
    the line stops there with its message, before MLflow or Ray starts (it started MLflow with the password
    "None"); when it prints one, MLflow's admin gets it, then Ray starts."""
    calls, answer, bin_ = tmp_path / "calls", tmp_path / "answer", tmp_path / "bin"
    bin_.mkdir()
    stubs = {"hostname": "echo 10.0.0.5", "pgrep": "exit 1", "ray": f'echo "ray $1 $2" >> {calls}',
             "mlflow": f'echo "mlflow $MLFLOW_AUTH_ADMIN_PASSWORD" >> {calls}',
             "python": f'case "$2" in *"from core.tracking import admin_password"*) '
                       f'cat {answer} 2>/dev/null || {{ echo "error: no MLflow password" >&2; exit 1; }};; '
                       f'*) exec {sys.executable} "$@";; esac'}
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    line = cluster["head_start_ray_commands"][1].replace("/tmp/mlflow.log", str(tmp_path / "mlflow.log"))

    def start() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", line], env={"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path)},
                              capture_output=True, text=True, timeout=60)

    stopped = start()
    assert (stopped.returncode, stopped.stderr) == (1, "error: no MLflow password\n") and not calls.exists()
    answer.write_text("s3cr3t\n")
    assert start().returncode == 0
    for _ in range(100):  # MLflow is started in the background
        if calls.exists() and len(calls.read_text().splitlines()) == 2:
            break
        time.sleep(0.1)
    assert sorted(calls.read_text().splitlines()) == ["mlflow s3cr3t", "ray start --head"]


def test_every_node_runs_ray_with_its_token_from_outside_the_repository(cluster):
    """RAY_AUTH_MODE=token in every container (head and workers, and whatever `ray exec` runs there); the token
    reaches each node as a file mount from the home of the machine that runs `ray up` (the head's autoscaler copies
    it to each worker it starts), so no token is in any file here."""
    assert "--env RAY_AUTH_MODE=token" in cluster["docker"]["run_options"]
    assert not any("RAY_AUTH_MODE" in o for key in ("head_run_options", "worker_run_options")
                   for o in cluster["docker"].get(key, []))
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert not any(Path(local).expanduser().resolve().is_relative_to(ROOT) for local in cluster["file_mounts"].values())
    text = (ROOT / "cluster.yaml").read_text()
    assert "RAY_AUTH_TOKEN=" not in text and "RAY_AUTH_MODE=disabled" not in text


def test_mlflow_asks_every_client_for_its_password(cluster):
    """The head starts MLflow's basic-auth app (once: a second `ray up` leaves it running), its users on /fsx, new
    users with no permission; its admin password and every client's (job drivers on the head, training workers on
    the GPU nodes) come from MLflow's own credentials file, mounted like Ray's token; the image has what the app
    needs (mlflow[auth]: Flask-WTF)."""
    head = " ".join(cluster["head_start_ray_commands"])
    server = head[head.index("mlflow server"):head.index("> /tmp/mlflow.log")]
    assert "--app-name basic-auth" in server and "--host 0.0.0.0" not in server
    guard = re.search(r'pgrep -f "([^"]+)"', head)[1]  # finds a running MLflow, not the shell that runs this line
    assert re.search(guard, "/opt/venv/bin/python /opt/venv/bin/mlflow server --app-name basic-auth")
    assert not re.search(guard, f"bash --login -c -i {head}")
    assert "MLFLOW_AUTH_CONFIG_PATH=/opt/opt-pipeline/configs/mlflow_auth.ini" in head
    assert "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in head  # no Huey consumer polling for jobs we never submit
    assert 'MLFLOW_AUTH_ADMIN_PASSWORD="$ADMIN_PASSWORD"' in head  # admin_password(): the credentials file's
    assert cluster["file_mounts"]["~/.mlflow/credentials"] == "~/.mlflow/credentials"
    auth = configparser.ConfigParser()  # read as mlflow/server/auth/config.py reads it
    auth.read(ROOT / "configs" / "mlflow_auth.ini")
    assert (auth["mlflow"]["default_permission"], auth["mlflow"]["database_uri"]) == (
        "NO_PERMISSIONS", "sqlite:////fsx/mlflow/basic_auth.db")
    assert "admin_password" not in auth["mlflow"]  # from the credentials file, at start
    assert '"mlflow[auth]"' in (ROOT / "Dockerfile").read_text()


def test_the_dockerfile_pins_what_it_downloads_and_checks_it():
    """torch by version from the CUDA index that matches the base image's CUDA (DeepSpeed's ops are compiled with
    its nvcc) and the CPU build the suite runs; the EFA installer by version and SHA-256, checked before it is
    unpacked; nothing piped from curl into tar or a shell."""
    image = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # a RUN's continued lines as one
    assert not re.search(r"curl[^\n]*\|\s*(tar|sh|bash)\b", image)
    cuda = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-", image, re.M)
    torch = re.search(r"pip install torch==(\S+) --index-url https://download\.pytorch\.org/whl/cu(\d+)\b", image)
    assert cuda and torch and torch[2] == cuda[1] + cuda[2]
    assert f"torch=={torch[1]}" in (ROOT / "Makefile").read_text()
    args = dict(re.findall(r"^ARG (EFA_INSTALLER_\w+)=(\S+)$", image, re.M))
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["EFA_INSTALLER_VERSION"])
    assert re.fullmatch(r"[0-9a-f]{64}", args["EFA_INSTALLER_SHA256"])
    efa = next(step for step in image.split("\nRUN ") if "efa-installer.amazonaws.com" in step)
    assert "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in efa and "latest" not in efa
    assert efa.index("sha256sum -c") < efa.index("tar x") < efa.index("efa_installer.sh")


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
