"""pipelines/compare.py's verdicts and its refusal of ablations evaluated on different sets (on an MLflow store of its
own: the sample's real ablations are compared in tests/test_ablation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import write_config
from pipelines import compare


def test_a_verdict_says_worse_only_beyond_the_seed_noise():
    from core.stats import Difference, difference, paired_noise
    from pipelines.compare import verdict

    rng = np.random.default_rng(0)
    base = list(2.0 + rng.normal(0, 0.01, 3))
    alpha = 0.05 / 14
    # The same runs, bit for bit: nothing to tell, and nothing of the noise either.
    same = difference(base, base, alpha, paired_noise(base, [base]))
    assert same == Difference(0.0, 0.0, "within") and verdict(same) == "within noise"
    assert paired_noise(base, [base]) == (0.0, 0)
    shifted = [b + 0.1 + e for b, e in zip(base, rng.normal(0, 0.002, 3))]
    worse = difference(base, shifted, alpha, paired_noise(base, [shifted]))
    assert verdict(worse) == "worse" and worse.delta == pytest.approx(0.1, abs=0.01) and 0 < worse.half < 0.1
    assert verdict(difference(shifted, base, alpha, paired_noise(shifted, [base]))) == "better"
    # Seed-to-seed noise as large as the shift: not a difference anyone can claim from 3 seeds.
    noisy = [b + 0.1 + e for b, e in zip(base, rng.normal(0, 0.2, 3))]
    assert verdict(difference(base, noisy, alpha, paired_noise(base, [noisy]))) == "within noise"
    # The spread pooled with a second ablation's (its own effect does not count): the degrees of freedom add up.
    second = [b - 0.5 + e for b, e in zip(base, rng.normal(0, 0.002, 3))]
    ss, df = paired_noise(base, [shifted, second])
    assert df == 4 and ss == pytest.approx(paired_noise(base, [shifted])[0] + paired_noise(base, [second])[0])
    # Other seeds than the base's: Welch's t over the two groups.
    welch = difference(base, list(2.5 + rng.normal(0, 0.01, 4)), 0.05)
    assert verdict(welch) == "worse" and np.isfinite(welch.half)
    assert verdict(difference(base[:1], shifted[:1], 0.05, paired_noise(base[:1], [shifted[:1]]))) == "no interval (1 seed)"


def test_the_mean_interval_is_students_t_over_the_seeds():
    from scipy import stats as scipy_stats

    from core.stats import mean_interval

    values = [1.0, 1.2, 0.9, 1.1]
    expected = scipy_stats.t.ppf(0.975, 3) * np.std(values, ddof=1) / np.sqrt(4)
    assert mean_interval(values, 0.05) == pytest.approx(expected, rel=1e-12)
    assert np.isnan(mean_interval([1.0], 0.05))


def pipeline_run(client, experiment: str, name: str, tags: dict, bpb: list[float] | None,
                 status: str = "FINISHED") -> None:
    """A pipeline run as full.py leaves it: tagged with its ablation, a train stage run under it logging each
    seed's bits per byte (none: no train stage), both ended with `status`."""
    parent = client.create_run(experiment, tags={"kind": "pipeline", "ablation": name})
    if bpb is not None:
        train = client.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id, "stage": "train",
                                                    "eval.fingerprint": "aaaaaaaaaaaaaaaa",
                                                    "eval.seeds": ",".join(map(str, range(len(bpb)))), **tags})
        for seed, value in enumerate(bpb):
            client.log_metric(train.info.run_id, f"seed{seed}/eval.bpb", value)
        client.set_terminated(train.info.run_id, status)
    client.set_terminated(parent.info.run_id, status)


def test_a_failed_seed_or_a_zero_spread_gives_no_verdict_and_no_noise_to_the_others():
    """A NaN or inf seed makes its row `failed seed S` (its own, or base's for every ablation) and stays out of the
    pooled spread, where it would have made every paired interval NaN, `within noise`; a spread of exactly 0
    gives no verdict, where it gave a zero-width interval and a verdict on any difference."""
    from core.stats import ZERO_SPREAD, difference, paired_noise
    from pipelines.ablations import Ablation

    def ablation(name, values):
        return Ablation(name, "", bpb={"": values}, seeds=list(range(len(values))))

    base = ablation("base", [2.0, 2.1, 1.9])
    shifted = ablation("shifted", [2.3, 2.4, 2.2])  # +0.3 on every seed: a spread of 0
    diverged = ablation("diverged", [2.0, float("nan"), 1.9])
    noisy = ablation("noisy", [2.31, 2.38, 2.21])
    _, _, found = compare.verdicts([base, shifted, diverged, noisy])
    assert compare.verdict(found["diverged"][""]) == "failed seed 1 (diverged)"
    assert compare.verdict(found["noisy"][""]) == "worse"  # the NaN did not reach the pooled spread
    assert np.isfinite(found["noisy"][""].half)
    _, _, found = compare.verdicts([ablation("base", [2.0, float("inf"), 1.9]), noisy])
    assert compare.verdict(found["noisy"][""]) == "failed seed 1 (base)"
    assert difference([2.0, 2.1], [2.3, 2.4], 0.05, paired_noise([2.0, 2.1], [[2.3, 2.4]])).side == ZERO_SPREAD
    assert difference([2.0, 2.0], [2.3, 2.3, 2.3], 0.05).side == ZERO_SPREAD  # Welch's: both groups without spread
    assert "failed seed 1 (diverged)" in compare.bpb_table([base, diverged])


def test_compare_refuses_a_missing_or_failed_reference(tmp_path, capsys):
    """Only finished runs count: a base whose only pipeline run failed is missing, and compare says so (exit 2)
    rather than measuring the others against the next ablation; a finished base without a training run, while
    others have one, is refused too."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    pipeline_run(client, experiment, "base", {}, [1.5, 1.51], status="FAILED")
    pipeline_run(client, experiment, "drop-x", {}, [1.6, 1.62])
    pipeline_run(client, experiment, "drop-y", {}, [1.4, 1.41])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]

    def error() -> str:
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        return line

    assert compare.main(args) == 2
    assert "no finished pipeline run tagged ablation='base'" in error()
    pipeline_run(client, experiment, "base", {}, None)  # finished, but only up to dedup (`--only dedup`)
    assert compare.main(args) == 2
    assert "base, the reference, has no finished training run" in error()
    assert compare.main([*args, "drop-y", "drop-x"]) == 0  # a reference named: measured against it
    assert "vs drop-y: drop-x" in capsys.readouterr().out


def test_compare_refuses_runs_evaluated_on_different_sets(tmp_path, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    for name, fingerprint in (("base", "aaaaaaaaaaaaaaaa"), ("other-eval", "bbbbbbbbbbbbbbbb")):
        pipeline_run(client, experiment, name, {"eval.fingerprint": fingerprint}, [1.5, 1.51])
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]
    assert compare.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]  # (MLflow logs too)
    assert len(err) == 1 and "eval.fingerprint=aaaaaaaaaaaaaaaa" in err[0] and "eval.fingerprint=bbbbbbbbbbbbbbbb" in err[0]
    assert compare.main([*args, "base"]) == 0  # one set: compared
    out = capsys.readouterr().out
    assert "all" in out and "1.5050" in out and "eval.fingerprint=aaaaaaaaaaaaaaaa" in out
