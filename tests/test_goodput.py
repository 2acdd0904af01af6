"""The goodput account (train/goodput.py) on a run's records written by hand: a crash, a health check, a hang
seen by two ranks, a redone step, validation, a checkpoint, a planned restart and the export, each second in exactly
one part."""

from __future__ import annotations

import json

import pytest

from train import goodput, records


def test_every_second_of_the_wall_time_is_in_one_part_and_ettr_counts_only_kept_steps(tmp_path):
    events = [("launch", 100), ("start", 102), ("built", 105), ("ready", 106),  # attempt 1: steps 1-3, then a crash
              ("health", 111, 1.5),  # the crashed rank's node probed between the attempts
              ("start", 112), ("built", 114), ("ready", 115),  # attempt 2 resumes at step 2: step 3 again, 4, then hangs
              ("hang", 127, 10.0), ("hang", 127.5, 10.5),  # the hung rank and a peer, both past the limit
              ("start", 130), ("built", 131), ("ready", 132),
              ("planned", 135.5),  # a straggler's node drained at step 5's checkpoint: the run restarts itself
              ("start", 136), ("built", 136.5), ("ready", 137), ("export", 139, 2.0),
              ("seed_runs", 143, 3.0), ("finish", 143)]  # the other seeds' evaluation-only runs, after the export
    lines = [{"event": e[0], "time": e[1], **({"seconds": e[2]} if len(e) > 2 else {})} for e in events]
    (tmp_path / records.TIMELINE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = [{"step": s, "loss": 5.0, "seconds": 1.0, "time": t} for s, t in ((1, 107), (2, 108), (3, 109),
                                                                            (3, 116), (4, 117), (5, 133))]
    rows += [{"step": 5, "eval.bpb": 5.0, "eval_seconds": 1.0, "time": 134},
             {"step": 5, "checkpoint.blocked_seconds": 0.5, "checkpoint.write_seconds": 3.0, "time": 135}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = goodput.account(tmp_path)
    expected = {"kept": 5.0, "lost": 1.0, "scheduling": 2.0, "health_check": 1.5, "startup_build": 3 + 2 + 1 + 0.5,
                "startup_load": 3.5, "restart": (112 - 109 - 1.5) + (130 - 127.5), "planned_restart": 136 - 135.5,
                "hang": 10.5, "checkpoint_blocked": 0.5, "evaluation": 1.0, "export": 2.0, "seed_runs": 3.0, "other": 2.0,
                "replacement_wait": 0.0}
    assert {p: report[f"{p}_seconds"] for p in goodput.PARTS} == pytest.approx(expected)
    assert report["wall_seconds"] == 43.0 and report["ettr"] == pytest.approx(5 / 43, abs=1e-4)
    assert "| restart | 4.0 | 9.3% |" in goodput.summary(report)
    assert goodput.plot(report, tmp_path / "goodput.png").stat().st_size > 5_000


def test_an_elastic_runs_wait_for_its_nodes_and_its_time_at_a_reduced_size_are_counted_apart(tmp_path):
    """A node lost after step 2: the group restarts with 1 of its 2 replicas, waits 5 s for a replacement that does
    not come, trains steps 3 and 4 short, grows back at step 4's checkpoint (planned), and trains step 5 whole."""
    events = [("launch", 100), ("start", 101), ("built", 102), ("ready", 103, None, 2),
              ("start", 110), ("built", 111), ("ready", 112, None, 1), ("waiting", 117, 5.0),
              ("planned", 121), ("start", 122), ("built", 123), ("ready", 124, None, 2), ("finish", 126)]
    lines = [{"event": e[0], "time": e[1], **({"seconds": e[2]} if len(e) > 2 and e[2] else {}),
              **({"replicas": e[3], "of": 2} if len(e) > 3 else {})} for e in events]
    (tmp_path / records.TIMELINE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = [{"step": s, "loss": 5.0, "seconds": sec, "time": t}
            for s, t, sec in ((1, 104, 1.0), (2, 105, 1.0), (3, 118.5, 1.5), (4, 120, 1.5), (5, 125, 1.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = goodput.account(tmp_path)
    assert report["replacement_wait_seconds"] == 5.0 and report["planned_restart_seconds"] == 1.0
    assert report["kept_seconds"] == 6.0 and report["kept_reduced_seconds"] == 3.0  # steps 3 and 4 only
    assert report["startup_load_seconds"] == 3.0  # each ready less its built; the wait comes after, in its own part
    assert "3.0 s trained on fewer replicas than configured" in goodput.summary(report)


def test_a_run_stopped_by_its_first_health_check_has_the_checks_wall_time(tmp_path):
    """Every node failed the check before the first start and none was drained (the cause looked systemic): the run
    ends at the check, and its wall time is the check's, not zero."""
    lines = [{"event": "launch", "time": 100.0}, {"event": "health", "time": 111.0, "seconds": 10.0}]
    (tmp_path / records.TIMELINE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = goodput.account(tmp_path)
    assert (report["wall_seconds"], report["health_check_seconds"], report["other_seconds"]) == (11.0, 10.0, 1.0)
