"""Shared fixtures: one Ray session for the whole test run (ray.init costs seconds), started as the
pipeline starts it, and one run of the whole pipeline on the sample corpus that the stage tests read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ray_session():
    import ray
    import ray.cloudpickle

    import minipipeline

    from pipelines.engines import init_ray

    # Test-only stage code lives in tests/, which Ray workers cannot import: ship it by value.
    ray.cloudpickle.register_pickle_by_value(minipipeline)
    init_ray(num_cpus=2)  # as pipelines/full.py starts it
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def deepspeed_rank():
    """This process as rank 0 of 1 of a gloo process group, as a CPU Ray Train worker is: DeepSpeed
    engines in the test process itself (checkpoints, the loss scaler, ZeRO-3's partitioned build).
    The group is made once and kept: DeepSpeed holds on to the first group it saw, process-wide."""
    import socket

    import deepspeed
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}.items():
            mp.setenv(key, value)
        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(port))
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no g++ build of a shared-memory op
            deepspeed.init_distributed(dist_backend="gloo")
        yield


@pytest.fixture(scope="session")
def sample(tmp_path_factory):
    """(folder, what it planted): the clean sample corpus, written once; tests only read it."""
    from corpus.sample import write_sample

    out = tmp_path_factory.mktemp("clean") / "sample"
    return out, write_sample(out)


def write_config(folder: Path, text: str, name: str = "test") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _no_outside_tracking_server(monkeypatch):
    """Tests track into their own sqlite store, never a server named by the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


SAMPLE_SOURCES = """
sources:
  - {{name: pile,       format: pile,      paths: ["{s}/pile/*.jsonl.zst"]}}
  - {{name: reddit,     format: pushshift, paths: ["{s}/reddit/RC_*.zst", "{s}/reddit/RS_*.zst"]}}
  - {{name: bookcorpus, format: text,      paths: ["{s}/bookcorpus/*.txt"]}}
  - {{name: stories,    format: text,      paths: ["{s}/stories/*.txt"]}}
  - {{name: ccnews,     format: jsonl,     paths: ["{s}/ccnews/*.jsonl"], text_field: text, id_field: id}}
normalize: {{min_chars: 20}}
screen: {{sources: [pile], steps: 60, seeds: 2, margin: 15.0, concurrent_runs: 2, runs_per_job: 9,
          proxy: {{model: tiny, seq_len: 64, global_batch_tokens: 2048, micro_batch_size: 32, lr: 1.0e-3, warmup_steps: 10,
                  num_workers: 1, cpus_per_worker: 1, zero_stage: 0}},
          tokenizer: {{kind: train, vocab_size: 4096}}}}
tokenize: {{seq_len: 64, validation_fraction: 0.05, tokenizer: {{kind: train, vocab_size: 1024}}}}
train: {{model: tiny, num_workers: 2, cpus_per_worker: 0.5, zero_stage: 2, precision: fp32, micro_batch_size: 4,
         global_batch_tokens: 1024, lr: 3.0e-3, warmup_tokens: 5120, total_tokens: 100000, max_steps: 30,
         checkpoint_every: 10, eval_every: 10, eval_batches: 2}}
"""


SPIKY = "HackerNews"  # the subset sample_run plants spiky


def manifest(workdir: Path, stage: str) -> dict:
    return json.loads((workdir / stage / "manifest.json").read_text())


def rows(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def stage_folder(workdir: Path, stage: str) -> Path:
    return Path(manifest(workdir, stage)["output"]).parent


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory, ray_session):
    """(sample folder, what the sample planted, workdir) after `full.py` over the sample corpus, whose
    HackerNews subset is planted spiky (the screen drops it; the config is configs/local.yaml's screen)."""
    from corpus.sample import write_sample
    from pipelines.full import main

    root = tmp_path_factory.mktemp("corpus")
    planted = write_sample(root / "sample", spiky_subset=SPIKY)
    cfg = write_config(root, f"workdir: {root}/work\n" + SAMPLE_SOURCES.format(s=root / "sample"), name="sample")
    assert main(["--config", str(cfg)]) == 0
    return root / "sample", planted, root / "work"
