"""How often is compare.py's verdict wrong, and how often right? Its error rate and power, measured on its own path.

    .venv/bin/python benchmarks/ablation_noise.py pool [--seeds 16] [--math-seeds 6] [--workdir /tmp/ablation-noise]
    .venv/bin/python benchmarks/ablation_noise.py calibrate [--workdir /tmp/ablation-noise] [--baseline 4722f6b]

`pool` trains the laptop's sample (configs/local.yaml) as it is on `--seeds` seeds (0, 1, ...: ablation `pool-base`)
and with the DM Mathematics subset dropped (`screen.drop`, a harmful ablation: arithmetic is a kind of text nothing
else in the sample writes) on the first `--math-seeds` of them (`pool-drop-math`). The stage cache shares the rest.

`calibrate` reads the pool from MLflow (pipelines/ablations.py, as compare.py does) and draws tables from it, each
judged by pipelines/compare.py's `verdicts`, at this commit and at `--baseline` (its rule, from `git archive`, in a
process of its own), on the same draws:

- **Null tables**: a base of n seeds, and two null ablations of other seeds of the same data (disjoint from the
  base's and each other's): one on its own seeds (compare takes Welch's t), and one whose values are relabelled with
  the base's seeds (compare pairs them) and whose deviations from the pool's mean are inflated 3x (an ablation
  noisier than the rest, as a shorter run or a smaller subset is). Any verdict on any row is a false one: the
  measured rates, per row and per table, are against the stated 5% per table, with Wilson intervals over the draws
  (drawn from one pool, so the pool's own luck is not in them; the synthetic tables below are free of it).
- **Power**: a base of n seeds, the DM Mathematics ablation on the same n seeds (paired), and one null ablation of
  other seeds (a table of two ablations, as the README's example): how often DM Mathematics' row says `worse`.
- **Synthetic tables**: the same layouts with Gaussian seeds, each row's spread and the DM Mathematics effect
  taken from the pool, many more draws: rates with tight intervals, and power for more seed counts.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH = "pile.DM Mathematics"
INFLATE = 3.0  # the noisy null ablation's deviations, against the others'


def pool(args) -> None:
    from pipelines.full import main as full

    for name, sets in (("pool-base", [f"train.seeds={args.seeds}"]),
                       ("pool-drop-math", [f"train.seeds={args.math_seeds}", "screen.drop=[DM Mathematics]"])):
        argv = ["--workdir", args.workdir, "--ablation", name]
        for item in [*sets, *args.set]:
            argv += ["--set", item]
        t0 = time.time()
        assert full(argv) == 0, f"{name} failed"
        print(f"[bench] {name}: {time.time() - t0:.0f}s", flush=True)


def read_pool(workdir: str) -> dict:
    """{ablation: {"seeds": [...], "bpb": {row: [one value per seed]}}} of the pool's two ablations."""
    from pipelines.ablations import read

    return {a.name: {"seeds": a.seeds, "bpb": a.bpb} for a in read(["pool-base", "pool-drop-math"], workdir=workdir)}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def null_tables(base: dict, n: int, draws: int, rng, synthetic: bool) -> list[list[tuple[str, list[int], dict]]]:
    """Null tables of (name, seeds, {row: values}): base, `other-seeds` (its own seeds) and `noisy` (relabelled with
    base's seeds, deviations inflated). From the pool's runs, or (synthetic) Gaussian with each row's pool spread."""
    import numpy as np

    rows, seeds = list(base["bpb"]), base["seeds"]
    values = np.array([base["bpb"][r] for r in rows])  # rows x seeds
    mean, sd = values.mean(axis=1, keepdims=True), values.std(axis=1, ddof=1, keepdims=True)
    out = []
    for _ in range(draws):
        if synthetic:
            b, o, z = (mean + sd * rng.standard_normal((len(rows), n)) for _ in range(3))
            sb, so = list(range(n)), list(range(100, 100 + n))
        else:
            pick = rng.choice(len(seeds), 3 * n, replace=False)
            b, o, z = (values[:, pick[k * n:(k + 1) * n]] for k in range(3))
            sb, so = [seeds[i] for i in pick[:n]], [seeds[i] for i in pick[n:2 * n]]
        z = mean + INFLATE * (z - mean)
        out.append([("base", sb, dict(zip(rows, b.tolist()))), ("other-seeds", so, dict(zip(rows, o.tolist()))),
                    ("noisy", sb, dict(zip(rows, z.tolist())))])
    return out


def power_tables(base: dict, math_run: dict, n: int, draws: int, rng, synthetic: bool) -> list:
    """Tables of base (n seeds), `drop-math` on the same seeds and a null ablation of other seeds."""
    import numpy as np

    rows, seeds = list(base["bpb"]), base["seeds"]
    values = np.array([base["bpb"][r] for r in rows])
    shared = [s for s in math_run["seeds"] if s in seeds]
    paired_b = np.array([[base["bpb"][r][seeds.index(s)] for s in shared] for r in rows])
    paired_m = np.array([[math_run["bpb"][r][math_run["seeds"].index(s)] for s in shared] for r in rows])
    diffs = paired_m - paired_b
    mean, sd = values.mean(axis=1, keepdims=True), values.std(axis=1, ddof=1, keepdims=True)
    out = []
    for _ in range(draws):
        if synthetic:
            b, o = (mean + sd * rng.standard_normal((len(rows), n)) for _ in range(2))
            d = diffs.mean(axis=1, keepdims=True) + diffs.std(axis=1, ddof=1, keepdims=True) * rng.standard_normal((len(rows), n))
            m, sb, so = b + d, list(range(n)), list(range(100, 100 + n))
        else:
            pick = rng.choice(len(shared), n, replace=False)
            others = [i for i in range(len(seeds)) if seeds[i] not in shared]
            rest = rng.choice(others, n, replace=False)
            b, m, o = paired_b[:, pick], paired_m[:, pick], values[:, rest]
            sb, so = [shared[i] for i in pick], [seeds[i] for i in rest]
        out.append([("base", sb, dict(zip(rows, b.tolist()))), ("drop-math", sb, dict(zip(rows, m.tolist()))),
                    ("other-seeds", so, dict(zip(rows, o.tolist())))])
    return out


def judge(tables: list) -> dict:
    """Each table through compare.verdicts (the tree on sys.path: this commit's or the baseline's): the false
    verdicts of the null ones, per row and per table; or, for power tables, DM Mathematics' verdicts."""
    from pipelines import compare
    from pipelines.ablations import Ablation

    macro = getattr(compare, "with_macro", lambda a: a)  # the macro average's row, as compare's table has it
    rows_judged = rows_wrong = tables_wrong = math_worse = 0
    for table in tables:
        ablations = [macro(Ablation(name, "", seeds=seeds, bpb=bpb)) for name, seeds, bpb in table]
        _, _, found = compare.verdicts(ablations)
        said = {(name, row): compare.verdict(d) for name, by_row in found.items() for row, d in by_row.items()}
        if "drop-math" in found:
            math_worse += said[("drop-math", MATH)] == "worse"
            said = {k: v for k, v in said.items() if k[0] != "drop-math"}
        wrong = [v for v in said.values() if v in ("worse", "better")]
        rows_judged, rows_wrong, tables_wrong = rows_judged + len(said), rows_wrong + len(wrong), tables_wrong + bool(wrong)
    return {"tables": len(tables), "rows": rows_judged, "rows_wrong": rows_wrong, "tables_wrong": tables_wrong,
            "math_worse": math_worse}


def measure(args) -> None:
    """Runs inside the tree whose rule is measured (sys.path[0]): every layout, printed as JSON."""
    import numpy as np

    data = json.loads(Path(args.pool_json).read_text())
    base, math_run = data["pool-base"], data["pool-drop-math"]
    found = {}
    for synthetic, draws in ((False, args.tables), (True, args.synthetic)):
        kind = "synthetic" if synthetic else "pool"
        for n in (2, 3, 4, 5):
            if 3 * n <= len(base["seeds"]) or synthetic:
                found[f"{kind} null n={n}"] = judge(null_tables(base, n, draws, np.random.default_rng(n), synthetic))
        for n in (2, 3, 4, 5, 6, 8):
            if n <= len(math_run["seeds"]) or synthetic:
                found[f"{kind} power n={n}"] = judge(power_tables(base, math_run, n, draws, np.random.default_rng(100 + n), synthetic))
    print(json.dumps(found))


def tree_of(commit: str, out: Path) -> Path:
    tree = out / f"tree-{commit}"
    if not tree.is_dir():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def seed_shape(base: dict) -> str:
    """The pool's seed noise, row by row: its spread, skewness and excess kurtosis (0 for a normal), and the seeds'
    common deviation (each seed's deviations in row spreads, averaged over the rows). A t interval holds its stated
    rate on normal seeds; far in its tail (a table's share of 5%) it does not on seeds that fall in two tight groups,
    and the common deviation shows whether they do."""
    import numpy as np
    from scipy import stats as st

    rows = list(base["bpb"])
    values = np.array([base["bpb"][r] for r in rows])
    z = (values - values.mean(axis=1, keepdims=True)) / values.std(axis=1, ddof=1, keepdims=True)
    lines = ["| row | mean | spread | skewness | excess kurtosis |", "|---|---|---|---|---|"]
    for r, v in zip(rows, values):
        lines.append(f"| {r or 'all'} | {v.mean():.4f} | {v.std(ddof=1):.4f} | {st.skew(v):+.2f} | {st.kurtosis(v):+.2f} |")
    common = z.mean(axis=0)
    lines.append(f"\nthe seeds' common deviation ({len(common)} seeds, sorted): "
                 + " ".join(f"{c:+.2f}" for c in sorted(common))
                 + f"; skewness {st.skew(common):+.2f}, excess kurtosis {st.kurtosis(common):+.2f}")
    return "\n".join(lines)


def calibrate(args) -> None:
    data = read_pool(args.workdir)
    pool_json = Path(args.workdir) / "pool.json"
    pool_json.write_text(json.dumps(data))
    print(f"pool: pool-base seeds {data['pool-base']['seeds']}, pool-drop-math seeds {data['pool-drop-math']['seeds']}; "
          f"{len(data['pool-base']['bpb'])} rows; {args.tables} draws from the pool, {args.synthetic} synthetic, per layout\n")
    print(seed_shape(data["pool-base"]) + "\n", flush=True)
    results = {}
    trees = [(args.baseline, tree_of(args.baseline, Path(args.workdir)))] if args.baseline else []
    for label, tree in (*trees, ("now", ROOT)):
        t0 = time.time()
        out = subprocess.run([sys.executable, __file__, "measure", "--root", str(tree), "--pool-json", str(pool_json),
                              "--tables", str(args.tables), "--synthetic", str(args.synthetic)],
                             capture_output=True, text=True, check=True).stdout
        results[label] = json.loads(out.strip().splitlines()[-1])
        print(f"[bench] {label}: {time.time() - t0:.0f}s", flush=True)
    report(results, args.baseline)


def report(results: dict, baseline: str) -> None:
    def rate(k: int, n: int) -> str:
        low, high = wilson(k, n)
        return f"{k / n:.2%} [{low:.2%}, {high:.2%}]" if n else "-"

    print("\n| layout | rule | tables | false verdicts per row | tables with any false verdict (stated: 5%) | "
          "now / baseline (tables) |")
    print("|---|---|---|---|---|---|")
    labels = [label for label in (baseline, "now") if label in results]
    for layout in (k for k in results["now"] if " null " in k):
        before = results[baseline][layout]["tables_wrong"] if baseline in results else 0
        for label in labels:
            r = results[label][layout]
            ratio = f"{r['tables_wrong'] / before:.2f}x" if label == "now" and before else ""
            print(f"| {layout} | {label} | {r['tables']} | {rate(r['rows_wrong'], r['rows'])} | "
                  f"{rate(r['tables_wrong'], r['tables'])} | {ratio} |")
    print("\n| layout | rule | tables | DM Mathematics dropped: `worse` (power) |")
    print("|---|---|---|---|")
    for layout in (k for k in results["now"] if " power " in k):
        for label in labels:
            r = results[label][layout]
            print(f"| {layout} | {label} | {r['tables']} | {rate(r['math_worse'], r['tables'])} |")


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pool")
    a.add_argument("--seeds", type=int, default=16)
    a.add_argument("--math-seeds", type=int, default=6)
    a.add_argument("--workdir", default="/tmp/ablation-noise")
    a.add_argument("--set", action="append", default=[], help="more overrides for both (full.py's --set)")
    c = sub.add_parser("calibrate")
    c.add_argument("--workdir", default="/tmp/ablation-noise")
    c.add_argument("--baseline", default="4722f6b", help="the commit whose rule is measured beside this one's ('': none, this tree's rule alone)")
    c.add_argument("--tables", type=int, default=2000)
    c.add_argument("--synthetic", type=int, default=10000)
    return p


def main() -> None:
    args = parser().parse_args()
    print(provenance.header(), flush=True)
    {"pool": pool, "calibrate": calibrate}[args.command](args)


def measure_main() -> None:
    """`measure`, inside the tree whose rule is measured: calibrate runs it twice. It imports nothing of this
    tree's before the measured tree is first on sys.path (provenance would bring this tree's `core`)."""
    m = argparse.ArgumentParser(prog="ablation_noise.py measure")
    m.add_argument("command")
    m.add_argument("--root", required=True)
    m.add_argument("--pool-json", required=True)
    m.add_argument("--tables", type=int, required=True)
    m.add_argument("--synthetic", type=int, required=True)
    args = m.parse_args()
    sys.path.insert(0, args.root)
    measure(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        measure_main()
    else:
        sys.path.insert(0, str(ROOT))
        import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

        main()
