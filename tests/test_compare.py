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


def test_compare_refuses_runs_evaluated_on_different_sets(tmp_path, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ablations", artifact_location=str(tmp_path / "artifacts"))
    for name, fingerprint in (("base", "aaaaaaaaaaaaaaaa"), ("other-eval", "bbbbbbbbbbbbbbbb")):
        parent = client.create_run(experiment, tags={"kind": "pipeline", "ablation": name})
        train = client.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id, "stage": "train",
                                                    "eval.fingerprint": fingerprint, "eval.seeds": "0,1"})
        for seed, value in ((0, 1.5), (1, 1.51)):
            client.log_metric(train.info.run_id, f"seed{seed}/eval.bpb", value)
    cfg = write_config(tmp_path, "sources: [{name: web, format: jsonl, paths: [x.jsonl]}]\n")
    args = ["--config", str(cfg), "--tracking-uri", uri, "--experiment", "ablations", "--out", str(tmp_path / "a.png")]
    assert compare.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]  # (MLflow logs too)
    assert len(err) == 1 and "eval.fingerprint=aaaaaaaaaaaaaaaa" in err[0] and "eval.fingerprint=bbbbbbbbbbbbbbbb" in err[0]
    assert compare.main([*args, "base"]) == 0  # one set: compared
    out = capsys.readouterr().out
    assert "all" in out and "1.5050" in out and "eval.fingerprint=aaaaaaaaaaaaaaaa" in out
