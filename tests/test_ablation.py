"""Data ablations: `--ablation NAME` tags the runs, the cache reuses what the ablation does not change,
and pipelines/compare.py puts the ablations side by side (on sample_run's workdir, restored after)."""

from __future__ import annotations

from pathlib import Path

from conftest import manifest

from pipelines import compare
from pipelines.full import main


def test_a_screen_ablation_reruns_the_screen_and_downstream_only(sample_run, tmp_path, capsys):
    from mlflow import MlflowClient

    _, _, wd = sample_run
    cfg = str(wd.parent / "sample.yaml")
    base = {stage: manifest(wd, stage) for stage in ("ingest", "normalize", "dedup", "screen", "tokenize", "train")}
    capsys.readouterr()
    try:
        assert main(["--config", cfg, "--set", "screen.enabled=false", "--ablation", "no-screen"]) == 0
        out = capsys.readouterr().out
        status = {line.split()[0]: line.split()[1] for line in out.split("finished; workdir")[1].splitlines()[1:]
                  if line.startswith("  ") and len(line.split()) > 1 and line.split()[0] in base}
        assert status == {"ingest": "cached", "normalize": "cached", "dedup": "cached", "screen": "ran", "tokenize": "ran",
                          "train": "ran"}
        off = {stage: manifest(wd, stage) for stage in base}
        assert off["dedup"]["fingerprint"] == base["dedup"]["fingerprint"]
        # One tokenizer for both (trained on normalize's output, which the screen does not change): a loss per token
        # means the same thing in each column.
        base_tok, off_tok = (Path(m["tokenize"]["output"]) / "tokenizer.json" for m in (base, off))
        assert base_tok != off_tok and base_tok.read_bytes() == off_tok.read_bytes()
        assert off["screen"]["counts"]["rows_out"] == off["screen"]["counts"]["rows_in"] == base["screen"]["counts"]["rows_in"]
        assert base["screen"]["counts"]["dropped"] > 0 and off["screen"]["proxy_runs"] == []

        client = MlflowClient(f"sqlite:///{wd}/mlflow.db")
        for stage in ("screen", "train"):
            run = client.get_run(off[stage]["mlflow_run_id"])
            assert run.data.tags["ablation"] == "no-screen"
            assert run.data.tags["ablation.diff"] == "screen.enabled: True -> False"
        assert client.get_run(base["train"]["mlflow_run_id"]).data.tags["ablation"] == "base"
        assert client.get_run(base["screen"]["proxy_runs"][0]["mlflow_run_id"]).data.tags["ablation"] == "base"

        chart = tmp_path / "ablations.png"
        assert compare.main(["--config", cfg, "--out", str(chart), "base", "no-screen"]) == 0
        table = capsys.readouterr().out
        header, _, *lines = table.splitlines()
        assert header.split() == ["base", "no-screen"]
        cells = {line[: line.index("  ")].strip(): line.split()[-2:] for line in lines if "  " in line}
        assert cells["screen dropped"] == [f"{base['screen']['counts']['dropped']:,}", "0"]
        assert cells["dedup duplicate"][0] == cells["dedup duplicate"][1]  # a cache hit: the same run's counts
        assert cells["screen dropped subsets"] == ["HackerNews", "none"]
        base_pile, off_pile = (int(c.replace(",", "")) for c in cells["tokens pile"])
        assert base_pile < off_pile  # HackerNews's tokens are back
        assert cells[compare.TRAIN_LOSS_ROW] == [f"{m['final_loss']:.4f}" for m in (base["train"], off["train"])]
        assert "tokens ccnews" in cells and "validation loss ccnews" in cells and "grad-norm spikes" in cells
        assert "no-screen: screen.enabled: True -> False" in table
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert compare.main(["--config", cfg, "--out", str(chart), "nope"]) == 2
        assert "no pipeline run tagged ablation='nope'" in capsys.readouterr().err
    finally:
        assert main(["--config", cfg]) == 0  # back to base: every stage a cache hit
    assert all(manifest(wd, s)["fingerprint"] == m["fingerprint"] for s, m in base.items())
    assert "running" not in capsys.readouterr().out
    assert Path(manifest(wd, "train")["output"]).is_dir()
