"""Does compare.py's verdict know the noise? Null ablations against real ones on the laptop's sample, repeated.

    .venv/bin/python benchmarks/ablation_noise.py [--repeats 3] [--seeds 3] [--workdir /tmp/ablation-noise] [--report]

Each repetition r trains the sample (configs/local.yaml) with `train.seeds` seeds from seed 1000 r, and
these ablations of it, each with the same seeds unless said:
- `same-data`: `train.checkpoint_every=100`, a config change that leaves the data and the training as
  they were (a null ablation: the runs are the same, bit for bit, on a CPU);
- `other-seeds`: the base's data with other seeds (1000 r + 500 ...): a null ablation that only the
  seed-to-seed noise separates from the base (Welch's t, since the seeds are not paired);
- `drop-stories`: `screen.drop=[stories]`, a source removed from training (the evaluation set keeps it).
  The sample writes stories, bookcorpus, ccnews, reddit and most Pile subsets with one prose
  generator, so this removes data of a kind the rest still has;
- `drop-math`: `screen.drop=[DM Mathematics]`, the one subset of a kind of its own (arithmetic);
- `keep-spiky`: `screen.enabled=false`, the planted spiky subset (HackerNews) kept in training.

Then pipelines/compare.py's verdicts (5% family-wise over each repetition's table) are counted per
ablation: how many rows came out worse, better or within noise, and the verdict on the rows each real
ablation is about. The stage cache shares what does not change (the corpus stages, and the screen
between repetitions).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

ABLATIONS = {  # name -> (--set overrides beyond the seeds, seed offset)
    "base": ([], 0),
    "same-data": (["train.checkpoint_every=100"], 0),
    "other-seeds": ([], 500),
    "drop-stories": (["screen.drop=[stories]"], 0),
    "drop-math": (["screen.drop=[DM Mathematics]"], 0),
    "keep-spiky": (["screen.enabled=false"], 0),
}
WATCHED = {"drop-stories": ["stories"], "drop-math": ["pile.DM Mathematics"], "keep-spiky": ["pile.HackerNews", "pile"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/ablation-noise")
    p.add_argument("--report", action="store_true", help="no runs: the verdicts of the runs already in --workdir")
    args = p.parse_args()
    print(provenance.header(), flush=True)

    from pipelines import compare
    from pipelines.ablations import read
    from pipelines.full import main as full

    began = time.time()
    if not args.report:
        for r in range(args.repeats):
            for name, (sets, offset) in ABLATIONS.items():
                overrides = [f"train.seeds={args.seeds}", f"train.seed={1000 * r + offset}", *sets]
                argv = ["--workdir", args.workdir, "--ablation", f"{name}-r{r}"]
                for item in overrides:
                    argv += ["--set", item]
                t0 = time.time()
                assert full(argv) == 0, f"{name}-r{r} failed"
                print(f"[bench] {name}-r{r}: {time.time() - t0:.0f}s", flush=True)
    counts: dict[str, collections.Counter] = {name: collections.Counter() for name in ABLATIONS if name != "base"}
    watched: dict[str, list[str]] = collections.defaultdict(list)
    for r in range(args.repeats):
        ablations = read([f"{name}-r{r}" for name in ABLATIONS], workdir=args.workdir)
        print(compare.bpb_table(ablations) + "\n", flush=True)
        rows, _, found = compare.verdicts(ablations)
        for tagged, by_row in found.items():
            name = tagged.rsplit("-r", 1)[0]
            counts[name].update(compare.verdict(d) for d in by_row.values())
            for row in WATCHED.get(name, []):
                d = by_row[row]
                watched[f"{name} on {row}"].append(f"{compare.verdict(d)} ({d.delta:+.3f} ± {d.half:.3f})")
    print(f"{args.repeats} repetitions of {args.seeds} seeds, {len(rows)} rows each; {time.time() - began:.0f}s\n")
    print("| ablation | rows worse | rows better | rows within noise |")
    print("|---|---|---|---|")
    for name, c in counts.items():
        print(f"| {name} | {c['worse']} | {c['better']} | {c['within noise']} |")
    print()
    for what, verdicts in watched.items():
        print(f"- {what}: {', '.join(verdicts)}")


if __name__ == "__main__":
    main()
