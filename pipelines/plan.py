"""`python -m pipelines.plan`: the layout planner's command line (train/plan/planner.py has the planner and
its flags, `parser`). It lives here, at the top, because it reads the whole pipeline's config.

Exit codes: 0 done (or --help); 2 a bad flag or config value, or a --layout that cannot run, in one line."""

from __future__ import annotations

import argparse
import json
import sys

from core.config import ConfigError
from pipelines.config import CHECKS, load_config
from train.plan.layout import Cluster, Layout, LayoutError, Workload, parse_layout, problem
from train.plan.planner import DEFAULT_CONFIG, breakdown, chart, inputs, make_plan, parser, report


def inputs_of(args: argparse.Namespace) -> tuple[Workload, Cluster, str | None, Layout | None]:
    """The planner's inputs (train/plan/planner.py's `inputs`) from the config the flags name and the flags."""
    config = load_config(args.config or DEFAULT_CONFIG, [], None, checks=CHECKS)
    return inputs(args, config.train, config.tokenize.seq_len)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        work, cluster, node, mine = inputs_of(args)
        if args.layout:  # the given layout takes the configured one's place in the chart
            mine = parse_layout(args.layout, cluster.gpus)
            reason = problem(mine, work, cluster)
            if reason:
                raise LayoutError(f"--layout {mine}: {reason}")
        plan = make_plan(work, cluster, node, mine)
        if args.layout:
            print(json.dumps([plan.configured.as_dict()], indent=1) if args.json else breakdown(plan.configured, plan))
        elif args.json:
            print(json.dumps([p.as_dict() for p in plan.ranked], indent=1))
        else:
            print(report(plan, args.top))
        if args.png and plan.ranked:
            chart(plan, args.png, args.top)
    except (ConfigError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
