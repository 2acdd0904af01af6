"""screen.png: the screen's decision, shown.

Left: every subset's paired effects (its roughness over the baseline mix's under the same seed),
one dot per seed, and the bounds it was judged by, against the line; colour by outcome. Right:
the grad-norm curve of each subset that was not kept beside the baseline mix's under the same
seed (the first seed), so that a reader sees what the numbers measured.
"""

from __future__ import annotations

import math
from pathlib import Path

from screen.score import BASELINE, DROP, INCONCLUSIVE, KEEP, Decision, effects
from train.spikes import read_run

COLOURS = {DROP: "tab:red", KEEP: "tab:green", INCONCLUSIVE: "tab:orange"}
MAX_CURVES = 4  # grad-norm panels at most (the subsets not kept with the largest effects)


def decision_chart(decisions: dict[str, Decision], runs: list[dict], stage_folder: Path, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    by = {(r["subset"], r["seed"]): r for r in runs}
    shown = sorted((d for d in decisions.values() if d.outcome != KEEP), key=lambda d: -d.effect)[:MAX_CURVES]
    fig = plt.figure(figsize=(12 if shown else 7, max(3.5, 0.45 * len(decisions) + 1.5)))
    grid = fig.add_gridspec(max(1, len(shown)), 2 if shown else 1, width_ratios=[1.2, 1] if shown else [1])
    ax = fig.add_subplot(grid[:, 0])
    order = sorted(decisions.values(), key=lambda d: d.effect)
    scores: dict[str, dict[int, float]] = {}
    for (name, seed), r in by.items():
        scores.setdefault(name, {})[seed] = r["score"]
    per_seed = effects({d.subset: scores[d.subset] for d in order}, scores[BASELINE])  # what each subset was judged on
    for y, d in enumerate(order):
        colour = COLOURS[d.outcome]
        points = [math.exp(e) for e in per_seed[d.subset]]
        ax.scatter(points, [y] * len(points), color=colour, s=14, alpha=0.7, zorder=3)
        low, high = (math.exp(min(max(v, -50), 50)) for v in (d.low, d.high))
        ax.plot([low, high], [y, y], color=colour, linewidth=3, alpha=0.5)
    ax.axvline(math.exp(order[0].line), color="black", linestyle="--", linewidth=1, label=f"line {math.exp(order[0].line):.2f}x")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yticks(range(len(order)), [f"{d.subset} ({d.outcome}, {d.seeds} seeds)" for d in order], fontsize=8)
    ax.set_xlabel("roughness / baseline mix's, same seed (dots: seeds; bar: bounds)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("the screen's decision")
    for i, d in enumerate(shown):
        curve = fig.add_subplot(grid[i, 1])
        seed = min(seed for (name, seed) in by if name == d.subset)
        for name, colour in ((BASELINE, "grey"), (d.subset, COLOURS[d.outcome])):
            record = by.get((name, seed))
            if record is not None:
                batches, norms = read_run(stage_folder / record["run_dir"])
                curve.plot(batches + 1, norms, color=colour, linewidth=1, label=f"{name} seed {seed}")
        curve.set_ylabel("grad norm", fontsize=8)
        curve.legend(fontsize=7, loc="upper right")
        curve.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
