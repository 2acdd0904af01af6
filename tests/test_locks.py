"""One run at a time per workdir (core/locks.py): a second run stops with one line and touches nothing; a run
that died holding the workdir is taken over, and that is said."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, write_config
from core import locks
from pipelines.full import main

HOLD = ("import sys, time\nfrom core import locks\nwith locks.hold(sys.argv[1], 'local [base]'):\n"
        "    print('held', flush=True)\n    time.sleep(120)\n")


def holder(workdir) -> subprocess.Popen:
    """Another run: a process holding the workdir's lock, as full.py does while it runs."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_on_a_held_workdir_exits_2_and_leaves_the_first_runs_output(tmp_path, capsys):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "x.jsonl").write_text('{"text": "hi"}\n')
    cfg = write_config(tmp_path, f'sources: [{{name: a, format: jsonl, paths: ["{tmp_path}/raw/*.jsonl"]}}]\n')
    work = tmp_path / "work"
    partial = work / "ingest" / ".partial-0123456789abcdef-1"  # the first run's stage, being written
    partial.mkdir(parents=True)
    first = holder(work)
    try:
        assert main(["--config", str(cfg), "--workdir", str(work)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: workdir {work} is in use by another run (pid {first.pid} on ")
        assert "local [base]" in err[0]
        assert partial.is_dir() and sorted(p.name for p in work.iterdir()) == [".lock", "ingest"]
    finally:
        first.kill()
        first.wait()
    # Killed, it could not release the lock: the kernel did. Its note stays, and the next run takes over.
    with locks.hold(work, "next") as stale:
        assert stale.startswith(f"pid {first.pid} on ") and stale.endswith(": local [base]")
    with locks.hold(work, "after a clean end") as stale:
        assert stale is None


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    """A `.lock` planted as a link had its target's first 4 KiB printed as the stale note, then emptied."""
    import pytest

    target = tmp_path / "auth_token"
    target.write_text("secret")
    work = tmp_path / "work"
    work.mkdir()
    (work / locks.LOCK_FILE).symlink_to(target)
    with pytest.raises(locks.WorkdirBusy, match=r"\.lock is a symbolic link \(to .*auth_token\), not a lock a run made"):
        with locks.hold(work, "this run"):
            pass
    assert target.read_text() == "secret"
