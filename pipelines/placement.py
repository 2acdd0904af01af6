"""`python -m pipelines.placement`: where Ray Train puts the configured training layout's workers, asked of
the cluster before a long run (train/parallel/placement.py has the probe and says what it shows). It lives
here, at the top, because it reads the whole pipeline's config."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError
from core.ray_session import start_ray
from pipelines.config import CHECKS, load_config
from train.parallel.placement import probe, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.placement", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="the pipeline config whose train section is placed (default: configs/local.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as full.py's")
    args = parser.parse_args(argv)
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
