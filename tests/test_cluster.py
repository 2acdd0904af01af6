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
