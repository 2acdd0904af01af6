"""The run folder's records (train/records.py): each row written with its kind and read back by it, rows of
earlier versions classified, and each file of the folder named in that one module."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from train import goodput, health, records, spikes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "model", "corpus", "dedup", "train", "screen", "pipelines", "benchmarks")


def test_a_row_is_written_with_its_kind_and_read_back_by_it(tmp_path):
    """metrics.jsonl holds three kinds: a reader of one never sees another's rows, whatever keys they share."""
    records.append(tmp_path, records.STEP, {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "seconds": 0.5, "time": 10.0})
    records.append(tmp_path, records.EVALUATION, {"step": 1, "eval.bpb": 2.0, "eval_seconds": 0.2, "time": 11.0})
    records.append(tmp_path, records.CHECKPOINT, {"step": 1, "checkpoint.blocked_seconds": 0.1,
                                                  "checkpoint.write_seconds": 0.3, "time": 12.0})
    rows = [json.loads(line) for line in (tmp_path / records.METRICS).read_text().splitlines()]
    assert [r["record"] for r in rows] == ["step", "evaluation", "checkpoint"]
    assert [r["time"] for r in records.read(tmp_path, records.EVALUATION)] == [11.0]
    assert [r["record"] for r in records.read(tmp_path, records.CHECKPOINT, records.STEP)] == ["step", "checkpoint"]
    with pytest.raises(ValueError, match="a step row of metrics.jsonl needs loss, seconds"):
        records.append(tmp_path, records.STEP, {"step": 2, "lr": 1e-3, "grad_norm": 1.0, "time": 13.0})
    with pytest.raises(ValueError, match="one file's kinds at a time"):
        records.read(tmp_path, records.STEP, records.INCIDENT)
    assert len(records.read(tmp_path, records.STEP)) == 1  # the refused row was not written
    assert records.read(tmp_path / "none", records.STEP) == [] and records.read_summary(tmp_path) == {}


def test_rows_written_before_kinds_are_classified_where_they_are_read(tmp_path):
    """A run folder of an earlier version (no `record` on any row) still reads: its steps, evaluations, saves,
    stragglers and drains each go where they did, through the stage's readers, the goodput account, the drain
    limit and the screen's grad norms."""
    metrics = [{"step": 1, "loss": 5.0, "grad_norm": 1.0, "seconds": 1.0, "time": 101.0},
               {"step": 1, "eval.bpb": 2.0, "eval_seconds": 0.5, "time": 102.0},
               {"step": 1, "checkpoint.blocked_seconds": 0.25, "checkpoint.write_seconds": 1.0, "time": 103.0},
               {"step": 2, "loss": 4.0, "grad_norm": 2.0, "seconds": 1.0, "time": 104.0}]
    stragglers = [{"node": "n2", "rank": 1, "step": 8, "host": "h", "seconds": 0.3, "others_seconds": 0.1, "time": 104.0},
                  {"node": "n2", "rank": 1, "step": 10, "drained": True, "refused": None, "time": 104.0}]
    timeline = [{"event": "launch", "time": 100.0}, {"event": "finish", "time": 105.0}]
    for name, rows in ((records.METRICS, metrics), (records.STRAGGLERS, stragglers), (records.TIMELINE, timeline)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in records.read(tmp_path, records.STEP)] == [1, 2]
    assert [r["record"] for r in records.read(tmp_path, records.STRAGGLER, records.DRAIN)] == ["straggler", "drain"]
    assert [r["event"] for r in records.read(tmp_path, records.EVENT)] == ["launch", "finish"]
    report = goodput.account(tmp_path)
    assert (report["kept_seconds"], report["evaluation_seconds"], report["checkpoint_blocked_seconds"]) == (2.0, 0.5, 0.25)
    assert health.drained_nodes(tmp_path) == ["n2"]
    assert spikes.read_grad_norms(tmp_path) == [1.0, 2.0]


def run_folder_names() -> set[str]:
    return {v for k, v in vars(records).items() if k.isupper() and isinstance(v, str)}


def test_each_file_of_the_run_folder_is_named_in_one_module():
    """A run folder's file or folder name as a string anywhere but train/records.py is a second owner: a reader
    that can drift from the writer. Docstrings and comments may mention them; code may not."""
    names = run_folder_names()
    assert {"metrics.jsonl", "summary.json", "LOGBOOK.md", "ranks"} <= names
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "train" / "records.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "run-folder names outside train/records.py:\n" + "\n".join(found)
