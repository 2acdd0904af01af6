"""`python -m pipelines.placement`: where Ray Train puts the configured training layout's workers, asked of
the cluster before a long run (train/parallel/placement.py has the probe and says what it shows). It lives
here, at the top, because it reads the whole pipeline's config.

Exit codes: 0 every tensor group on one machine; 1 a tensor group would span machines (each named); 2 a bad flag or
config value, in one line."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError
from core.ray_session import start_ray
from pipelines.config import CHECKS, load_config
from train.parallel.placement import probe, table


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m pipelines.placement", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="the pipeline config whose train section is placed (default: configs/local.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as full.py's")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = load_config(args.config, args.set, None, checks=CHECKS)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start_ray(config.ray)
    rows = probe(config.train, config.workdir)
    print(table(rows))
    problems = sorted({r["problem"] for r in rows if r["problem"]})
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
