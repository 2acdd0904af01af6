"""The run's chart, like the OPT chronicles' figures: loss, grad norm, loss scale and LR against steps,
each restart or rollback a new segment, every autopilot intervention marked."""

from __future__ import annotations

from pathlib import Path

PANELS = (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"), ("lr", "learning rate"))


def segments(rows: list[dict]) -> list[list[dict]]:
    """A run's step rows in the order written, cut wherever the step goes back (a rollback or restart)."""
    out: list[list[dict]] = []
    for row in rows:
        if not out or row["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(row)
    return out


def plot_run(steps: list[dict], logbook: list[dict], out: Path) -> Path:
    """`steps`: the run's step rows (train/records.py); `logbook`: its logbook entries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 9), sharex=True)
    for i, segment in enumerate(segments(steps)):
        for ax, (key, _) in zip(axes, PANELS):
            points = [(r["step"], r[key]) for r in segment if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), linewidth=1, color=f"C{i % 10}", label=f"segment {i + 1}" if key == "loss" else None)
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_ylabel(title)
        if key in ("grad_norm", "loss_scale", "lr"):
            ax.set_yscale("log")
        for entry in logbook:
            ax.axvline(entry["step"], color="red", linestyle="--", linewidth=0.8)
    for n, entry in enumerate(logbook, 1):  # numbered as in LOGBOOK.md; the actions are there
        label = axes[0].annotate(f"{n}: {entry['kind']}", (entry["step"], 0.97), xycoords=("data", "axes fraction"),
                                 rotation=90, va="top", ha="right", fontsize=7, color="red")
        label.set_in_layout(False)
    axes[-1].set_xlabel("step")
    axes[0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
