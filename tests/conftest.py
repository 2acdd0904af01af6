"""Shared fixtures: one Ray session for the whole test run (ray.init costs seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ray_session():
    import ray
    import ray.cloudpickle

    import minipipeline

    # Test-only stage code lives in tests/, which Ray workers cannot import: ship it by value.
    ray.cloudpickle.register_pickle_by_value(minipipeline)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def write_config(folder: Path, text: str, name: str = "test") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _no_outside_tracking_server(monkeypatch):
    """Tests track into their own sqlite store, never a server named by the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
