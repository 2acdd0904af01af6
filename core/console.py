"""What the terminal shows while the pipeline runs, and where everything else goes.

For people: a line when a stage starts and when it ends (rows, time), a progress bar for the long
ones (files, phases, steps), and the problems a person must see: a failed stage, rejected input
records, autopilot interventions and worker restarts (`note`). On a terminal the bars are tqdm's;
in a log (`ray job submit`, CI) a bar is a line every `LOG_EVERY` seconds instead, so a stage that
runs for hours still says how far it is.

Ray's own output is not for the terminal: the driver's `ray` loggers write to the stage's log
file (`stage_log`) and Ray's session logs, and the output of workers, raylet and GCS stays in the
session logs (`ray.init(log_to_driver=False)`, core/ray_session.py). Errors still reach the
terminal. `--verbose` brings all of Ray's output back.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Iterator

# The driver's Ray loggers. Neither propagates to the root logger, so a stage's log file is attached
# to each of them as well as to the root.
RAY_LOGGERS = ("ray", "ray.data")
LOG_EVERY = 30.0  # seconds between progress lines when the output is not a terminal


def route_ray_logging(verbose: bool) -> None:
    """The driver's Ray loggers pass INFO and up to every handler; their terminal handlers show only
    errors (all of it with `verbose`). Their file handlers (Ray Data's session log) are left alone."""
    import ray.data  # noqa: F401  (importing Ray sets these loggers up; after that they are ours to adjust)

    for name in RAY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.INFO if verbose else logging.ERROR)


class _StageLogHandler(logging.FileHandler):
    """A stage's log file. Its format stays ours: `ray.init` sets its own on every handler of the `ray`
    logger, and the first stage's handler is on it when Ray starts."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.setLevel(logging.INFO)

    def setFormatter(self, fmt) -> None:
        pass


@contextlib.contextmanager
def stage_log(path: Path) -> Iterator[None]:
    """Everything logged in this process while the stage runs, from INFO up, also into `path`: the
    stage's own logger, the libraries', and Ray's."""
    import ray.data  # noqa: F401  (its first import sets its logger up afresh, dropping handlers attached before)

    handler = _StageLogHandler(path)
    root = logging.getLogger()
    targets = [root] + [logging.getLogger(name) for name in RAY_LOGGERS]
    previous = root.level
    root.setLevel(min(previous, logging.INFO))
    for logger in targets:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in targets:
            logger.removeHandler(handler)
        root.setLevel(previous)
        handler.close()


def say(line: str) -> None:
    """A line of the pipeline's own account (stage started, done), above any progress bar."""
    _write(line, sys.stdout)


def note(stage: str, message: str) -> None:
    """Something a person must see: on the terminal (stderr, above any bar) and in the stage's log (when one
    is open: without any handler, Python's last resort would print the line a second time)."""
    logger = logging.getLogger(f"pipelines.stage.{stage}")
    if logger.hasHandlers():
        logger.warning(message)
    _write(f"[{stage}] {message}", sys.stderr)


def _write(line: str, stream) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=stream)  # clears and redraws an active bar around the line
    stream.flush()


class Bar:
    """Progress of one stage (or one phase of it): a tqdm bar on a terminal, else a line now and then."""

    def __init__(self, stage: str, unit: str, total: int | None, stream=None):
        self.stage, self.unit, self.total = stage, unit, total
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.postfix = 0, ""
        self._tqdm = None
        self._said_at = time.monotonic()
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=f"[{stage}]", unit=f" {unit}", file=self.stream, leave=False,
                              dynamic_ncols=True)

    def update_to(self, n: int, postfix: str = "") -> None:
        """Set the count (it may go back: a training run rolled back); `postfix`: e.g. the loss."""
        self.n, self.postfix = n, postfix
        if self._tqdm is not None:
            self._tqdm.n = n
            if postfix:
                self._tqdm.set_postfix_str(postfix, refresh=False)
            self._tqdm.refresh()
        elif time.monotonic() - self._said_at >= LOG_EVERY:
            self._said_at = time.monotonic()
            self.stream.write(f"[{self.stage}] {self.describe()}\n")
            self.stream.flush()

    def update(self, k: int = 1) -> None:
        self.update_to(self.n + k, self.postfix)

    def describe(self) -> str:
        done = f"{self.n:,}/{self.total:,} {self.unit}" if self.total else f"{self.n:,} {self.unit}"
        return done + (f", {self.postfix}" if self.postfix else "")

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
