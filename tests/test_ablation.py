"""Data ablations: `--ablation NAME` tags the runs, the cache reuses what the ablation does not change,
and pipelines/compare.py puts the ablations side by side (on sample_run's workdir, restored after)."""

from __future__ import annotations

from pathlib import Path

from conftest import manifest

from pipelines import compare
from pipelines.full import main


def test_a_dedup_threshold_ablation_reruns_dedup_and_downstream_only(sample_run, tmp_path, capsys):
    from mlflow import MlflowClient

    _, _, wd = sample_run
    cfg = str(wd.parent / "sample.yaml")
    base = {stage: manifest(wd, stage) for stage in ("ingest", "normalize", "dedup", "screen", "tokenize", "train")}
    capsys.readouterr()
    try:
        assert main(["--config", cfg, "--set", "dedup.threshold=0.8", "--ablation", "loose-dedup"]) == 0
        out = capsys.readouterr().out
        status = {line.split()[0]: line.split()[1] for line in out.split("finished; workdir")[1].splitlines()[1:]
                  if line.startswith("  ") and len(line.split()) > 1 and line.split()[0] in base}
        assert status == {"ingest": "cached", "normalize": "cached", "dedup": "ran", "screen": "ran", "tokenize": "ran",
                          "train": "ran"}
        loose = {stage: manifest(wd, stage) for stage in base}
        assert loose["normalize"]["fingerprint"] == base["normalize"]["fingerprint"]
        assert loose["dedup"]["counts"]["duplicate"] > base["dedup"]["counts"]["duplicate"]  # the 0.94 pair goes too

        client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
        for stage in ("dedup", "train"):
            run = client.get_run(loose[stage]["mlflow_run_id"])
            assert run.data.tags["ablation"] == "loose-dedup"
            assert run.data.tags["ablation.diff"] == "dedup.threshold: 0.95 -> 0.8"
        proxy = client.get_run(loose["screen"]["proxy_runs"][0]["mlflow_run_id"])
        assert proxy.data.tags["ablation"] == "loose-dedup"
        assert client.get_run(base["train"]["mlflow_run_id"]).data.tags["ablation"] == "base"

        chart = tmp_path / "ablations.png"
        assert compare.main(["--config", cfg, "--out", str(chart), "base", "loose-dedup"]) == 0
        table = capsys.readouterr().out
        header, _, *lines = table.splitlines()
        assert header.split() == ["base", "loose-dedup"]
        cells = {line[: line.index("  ")].strip(): line.split()[-2:] for line in lines if "  " in line}
        assert cells["dedup duplicate"] == [str(base["dedup"]["counts"]["duplicate"]), str(loose["dedup"]["counts"]["duplicate"])]
        assert cells["ingest rows_out"][0] == cells["ingest rows_out"][1]
        assert cells["screen dropped subsets"] == ["HackerNews", "HackerNews"]
        assert cells["train final loss"] == [f"{m['final_loss']:.4f}" for m in (base["train"], loose["train"])]
        assert "tokens ccnews" in cells and "validation loss ccnews" in cells and "grad-norm spikes" in cells
        assert "loose-dedup: dedup.threshold: 0.95 -> 0.8" in table
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert compare.main(["--config", cfg, "--out", str(chart), "nope"]) == 2
        assert "no pipeline run tagged ablation='nope'" in capsys.readouterr().err
    finally:
        assert main(["--config", cfg]) == 0  # back to base: every stage a cache hit
    assert all(manifest(wd, s)["fingerprint"] == m["fingerprint"] for s, m in base.items())
    assert "running" not in capsys.readouterr().out
    assert Path(manifest(wd, "train")["output"]).is_dir()
