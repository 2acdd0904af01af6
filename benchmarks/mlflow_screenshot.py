"""The ablations in MLflow's own UI, as a user sees them: `python benchmarks/mlflow_screenshot.py [--workdir work]`.

Starts `mlflow ui` on a workdir's store (the embedded run's, after `make run`, an ablation and compare.py), opens in
headless Chromium the newest comparison run and the experiment's runs table, both in the model-training view (the
links compare.py and full.py print), and saves a screenshot of each:
- `mlflow-comparison.png`: the comparison run's bits-per-byte table with its verdicts (Artifacts, as a table);
- `mlflow-runs.png`: the runs table in its saved view `ablations`: the pipeline runs' headline figures (`bpb.*`,
  `accuracy.*`) side by side.

Needs Chromium (Debian: `apt-get install chromium`; or `--chromium PATH`); the suite does not run it.
docs/ablations.md shows its screenshots and says how to read them.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tracking import program

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(uri: str, port: int, log: Path) -> subprocess.Popen:
    """`mlflow ui` on the store, once it answers."""
    server = subprocess.Popen([program("mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port",
                               str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"error: mlflow ui exited with {server.returncode}; its output: {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"error: mlflow ui did not answer within 120 s; its output: {log}")


def shoot(chromium: str, url: str, out: Path, size: str, wait_ms: int) -> None:
    """A headless Chromium screenshot of the page once its scripts have run for `wait_ms` of virtual time."""
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={size}",
                    f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=180)
    print(f"{out}: {url}")


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="work", help="the pipeline's workdir, whose mlflow.db to show (default: work)")
    p.add_argument("--experiment", default="local", help="the experiment (default: local, the embedded config's)")
    p.add_argument("--out", default="docs", help="where the screenshots go (default: docs, where docs/ablations.md shows them)")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium", help="the browser")
    p.add_argument("--wait-ms", type=int, default=20000, help="virtual time the pages get to load (default: 20000)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)  # the commit and machine the screenshots were taken at
    from mlflow import MlflowClient

    from core.tracking import ui_link
    from pipelines.ablation_runs import VIEW

    uri = f"sqlite:///{Path(args.workdir).resolve()}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"error: no experiment {args.experiment!r} in {uri}")
    found = client.search_runs([experiment.experiment_id], "tags.kind = 'comparison'",
                               order_by=["attributes.end_time DESC"], max_results=1)
    if not found:
        raise SystemExit(f"error: no comparison run in {args.experiment!r}: run pipelines/compare.py first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "mlflow-ui.log"
    server = serve(uri, port, log)
    try:
        local = f"http://127.0.0.1:{port}"
        run = ui_link(local, experiment.experiment_id, found[0].info.run_id)
        pages = {"mlflow-comparison.png": run.replace("?", "/artifacts/bits_per_byte.json?"),
                 "mlflow-runs.png": ui_link(local, experiment.experiment_id, view=VIEW)}
        for name, link in pages.items():
            shoot(args.chromium, link, out / name, "2000,1000", args.wait_ms)
    finally:
        server.terminate()
        server.wait(timeout=30)
    shutil.rmtree(log.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
