"""The layout planner: every tensor x pipeline x data layout that can run, priced and ranked, before a GPU is used.

    python -m pipelines.plan [--config C] [--model 175b] [--gpus N] [--gpu a100-40gb|a100-80gb|h100|h200]
                         [--gpus-per-node 8] [--node p4de.24xlarge] [--intra-gbps G] [--inter-gbps G]
                         [--batch-tokens T] [--seq-len S] [--precision bf16|fp16]
                         [--layout tp=8,pp=4,zero=1[,mb=1][,recompute=full]] [--json] [--png PATH] [--top K]

By default the model, batch, GPU count and configured layout come from the config
(configs/opt-175b.yaml unless --config), and the node type from cluster.yaml's GPU workers; a flag
overrides each. `--layout` prices one layout, term by term; without it every layout is ranked, best
first, with a line on why the configured one is not the best. The cost model is train/plan/layout.py;
the command line, which loads the pipeline's config, is pipelines/plan.py. pipelines/full.py runs `startup_check` before training on GPUs: a warning when the configured layout
is predicted more than 1.5x slower than the best, a refusal when it is predicted not to fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from model.configs import get, param_count
from core.config import ConfigError
from train.config import EngineConfig, TrainConfig
from train.plan.hardware import GPUS, NODES
from train.plan.layout import RECOMPUTE, Cluster, Layout, Prediction, Workload, predict, problem, refused_here
from train.rules import compile_rule, layout_rule

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "opt-175b.yaml"
DEFAULT_CLUSTER = ROOT / "cluster.yaml"
TENSOR = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
SLOWER_WARNING = 1.5  # full.py warns when the configured layout is predicted this much slower than the best
PLAN_COMMAND = "python -m pipelines.plan"


@dataclass
class Plan:
    work: Workload
    cluster: Cluster
    node: str | None  # the node type the cluster came from, if any
    ranked: list[Prediction]  # the layouts that fit, fastest first
    considered: int  # layouts that can run at all, fitting or not
    configured: Prediction | None  # the config's own layout
    zero3_alone: Prediction | None  # the fastest with tp = pp = 1 and ZeRO-3: the layout to beat

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def slowdown(self) -> float | None:
        """How many times slower the configured layout is predicted to be than the best."""
        if not self.configured or not self.best:
            return None
        return self.configured.step_seconds / self.best.step_seconds


# --------------------------------------------------------------------------- inputs


def cluster_node_type(path: Path = DEFAULT_CLUSTER) -> str | None:
    """The instance type of cluster.yaml's GPU workers (the first node type the planner knows)."""
    if not path.exists():
        return None
    spec = yaml.safe_load(path.read_text()) or {}
    for node in (spec.get("available_node_types") or {}).values():
        kind = ((node or {}).get("node_config") or {}).get("InstanceType")
        if kind in NODES:
            return kind
    return None


def configured_layout(t: TrainConfig, gpus: int) -> Layout:
    """The layout the training stage runs: train.parallel's tensor x pipeline, ZeRO data parallelism over what is left."""
    tp, pp = t.parallel.tensor, t.parallel.pipeline
    return Layout(tp, pp, gpus // (tp * pp), t.zero_stage, t.micro_batch_size, "full" if t.activation_checkpointing else "none")


def inputs(args: argparse.Namespace, t: TrainConfig, seq_len: int) -> tuple[Workload, Cluster, str | None, Layout | None]:
    """The workload, the cluster and the configured layout from the config's train section and
    tokenize.seq_len (`seq_len`), cluster.yaml and the flags."""
    work, cluster, node_name = workload(args, t, seq_len, float(t.total_tokens))
    mine = configured_layout(t, cluster.gpus) if work.model.name == t.model and t.gpus_per_worker >= 1 else None
    return work, cluster, node_name, mine


def workload(args: argparse.Namespace, t: EngineConfig, seq_len: int, total_tokens: float) -> tuple[Workload, Cluster, str | None]:
    """The workload and the cluster (and the node type it came from) of a training section `t` (train, or the
    screen's proxy section, which has no length of its own: `total_tokens`), cluster.yaml and the flags."""
    model = get(args.model or t.model)
    seq = args.seq_len or seq_len
    batch_tokens = args.batch_tokens or t.global_batch_tokens or model.batch_tokens
    if batch_tokens % seq:
        raise ConfigError("--batch-tokens", f"{batch_tokens} is not a whole number of {seq}-token sequences")
    precision = args.precision or t.precision
    if precision not in ("bf16", "fp16"):
        raise ConfigError("--precision", f"the planner prices bf16 or fp16 training, got {precision!r}")
    node_name = args.node or (None if args.gpu else cluster_node_type())
    if node_name and node_name not in NODES:
        raise ConfigError("--node", f"unknown node type {node_name!r}; known: {', '.join(NODES)}")
    node = NODES.get(node_name) if node_name else None
    gpu_name = args.gpu or (node.gpu if node else None)
    if gpu_name not in GPUS:
        raise ConfigError("--gpu", f"expected one of {', '.join(GPUS)} (or a --node), got {gpu_name!r}")
    gpu = GPUS[gpu_name]
    per_node = args.gpus_per_node or (node.gpus if node else 8)
    inter = args.inter_gbps or (node.inter_gbps if node else None)
    if inter is None:
        raise ConfigError("--inter-gbps", "the network between nodes is unknown without --node: give it in Gb/s per node")
    intra = args.intra_gbps or gpu.nvlink_bytes_s * 8 / 1e9 * per_node
    config_gpus = t.num_workers * max(1, t.gpus_per_worker)
    gpus = args.gpus or config_gpus
    if gpus % per_node and gpus > per_node:
        raise ConfigError("--gpus", f"{gpus} GPUs are not whole nodes of {per_node}")
    work = Workload(model, seq, batch_tokens // seq, precision, total_tokens)
    return work, Cluster(gpu, gpus, min(per_node, gpus), intra, inter), node_name


# --------------------------------------------------------------------------- ranking


def layouts(work: Workload, cluster: Cluster) -> Iterator[Layout]:
    """Every layout that can run: tp within a node, pp over the layers, dp what is left, each ZeRO stage,
    micro batch and recompute policy the engines allow and the training stage takes (layout.refused_here)."""
    for tp in TENSOR:
        if cluster.gpus % tp:
            continue
        for pp in range(1, min(work.model.n_layer, cluster.gpus // tp) + 1):
            if (cluster.gpus // tp) % pp:
                continue
            dp = cluster.gpus // (tp * pp)
            for zero in (0, 1, 2, 3):
                for mb in MICRO_BATCHES:
                    for recompute in RECOMPUTE:
                        layout = Layout(tp, pp, dp, zero, mb, recompute)
                        if problem(layout, work, cluster) is None and refused_here(layout, work) is None:
                            yield layout


def make_plan(work: Workload, cluster: Cluster, node: str | None = None, configured: Layout | None = None) -> Plan:
    predictions = [predict(layout, work, cluster) for layout in layouts(work, cluster)]
    # Equal times (the model prices ZeRO 0-2 alike wherever the optimizer's step is not sharded into view): the lower
    # stage first, as `zero_stage: auto` chooses (zero_stage_for), then the smaller memory.
    ranked = sorted((p for p in predictions if p.fits), key=lambda p: (p.step_seconds, p.layout.zero, p.memory_bytes))
    alone = [p for p in ranked if p.layout.tp == p.layout.pp == 1 and p.layout.zero == 3]
    mine = None
    if configured is not None and problem(configured, work, cluster) is None:
        mine = predict(configured, work, cluster)
    return Plan(work, cluster, node, ranked, len(predictions), mine, alone[0] if alone else None)


def why_not(plan: Plan) -> str | None:
    """One line: why the configured layout is not the best (the time term that differs most)."""
    mine, best = plan.configured, plan.best
    if not mine or not best or mine.layout == best.layout:
        return None
    if not mine.fits:
        return f"the configured {mine.layout} does not fit: {mine.why}"
    term = max(mine.time, key=lambda k: mine.time[k] - best.time[k])
    note = ""
    if term == "data parallel":
        note = (f" ({mine.traffic['data parallel']:.1f} s of data-parallel traffic per step, each GPU at "
                f"{plan.cluster.inter_bytes_s / 1e9:.2f} GB/s, its share of the node's {plan.cluster.inter_gbps:g} Gb/s)")
    return (f"the configured {mine.layout} is predicted {plan.slowdown():.1f}x slower than {best.layout}: "
            f"{term} takes {mine.time[term]:.1f} s per step against {best.time[term]:.1f} s{note}")


# --------------------------------------------------------------------------- output


def describe(plan: Plan) -> str:
    w, c = plan.work, plan.cluster
    where = f"{plan.node}: " if plan.node else ""
    return (f"OPT-{w.model.name} ({param_count(w.model) / 1e9:.1f}B parameters), {w.batch_seqs:,} x {w.seq_len} tokens per step, "
            f"{w.precision}, {w.total_tokens / 1e9:,.0f}B tokens; {c.gpus:,} x {c.gpu.name} ({where}{c.gpus_per_node} per node, "
            f"NVLink {c.intra_gbps:,.0f} Gb/s and network {c.inter_gbps:,.0f} Gb/s per node)")


TIME_TERMS = ("compute", "tensor parallel", "pipeline sends", "pipeline bubble", "data parallel", "optimizer")
MEMORY_TERMS = ("weights", "gradients", "optimizer", "gathered module", "activations", "logits", "allocator margin")


def table(rows: list[tuple[str, Prediction]]) -> list[str]:
    lines = ["| | layout | GB per GPU | step s | TFLOP/s | MFU | days | " + " | ".join(TIME_TERMS) + " |",
             "|---" * (7 + len(TIME_TERMS)) + "|"]
    for label, p in rows:
        terms = " | ".join(f"{p.time[k]:.2f}" for k in TIME_TERMS)
        lines.append(f"| {label} | {p.layout} | {p.memory_bytes / 1e9:.1f} | {p.step_seconds:.2f} | {p.tflops_per_gpu:.0f} | "
                     f"{p.mfu:.1%} | {p.days:.1f} | {terms} |")
    return lines


def memory_table(rows: list[tuple[str, Prediction]]) -> list[str]:
    lines = ["| | layout | " + " | ".join(MEMORY_TERMS) + " | total | fits |", "|---" * (4 + len(MEMORY_TERMS)) + "|"]
    for label, p in rows:
        terms = " | ".join(f"{p.memory[k] / 1e9:.1f}" for k in MEMORY_TERMS)
        lines.append(f"| {label} | {p.layout} | {terms} | {p.memory_bytes / 1e9:.1f} | {'yes' if p.fits else 'no: ' + p.why} |")
    return lines


def shown(plan: Plan, top: int) -> list[tuple[str, Prediction]]:
    rows = [[str(i + 1), p] for i, p in enumerate(plan.ranked[:top])]
    for label, p in (("ZeRO-3 alone", plan.zero3_alone), ("configured", plan.configured)):
        same = [row for row in rows if p is not None and row[1].layout == p.layout]
        if same:
            same[0][0] += f", {label}"
        elif p is not None:
            rows.append([label, p])
    return [(label, p) for label, p in rows]


def report(plan: Plan, top: int = 10) -> str:
    out = [describe(plan), ""]
    if not plan.ranked:
        out.append(f"none of the {plan.considered:,} layouts that can run fits in {plan.cluster.gpu.memory_bytes / 1e9:.1f} GB per GPU")
    else:
        out.append(f"{plan.considered:,} layouts can run, {len(plan.ranked):,} fit; the fastest {min(top, len(plan.ranked))}, "
                   "then the fastest ZeRO-3 alone and the configured layout. Seconds per step by term; TFLOP/s are model "
                   "FLOPs (recompute not counted) per GPU:")
        out += ["", *table(shown(plan, top)), "", "Memory per GPU (GB) on the stage that needs most:", "",
                *memory_table(shown(plan, top))]
    line = why_not(plan)
    if line:
        out += ["", "Why not the configured layout: " + line]
    return "\n".join(out)


def breakdown(p: Prediction, plan: Plan) -> str:
    """One layout, every term."""
    out = [describe(plan), "", f"{p.layout}: {p.micro_batches} micro-batches per step, bubble {p.bubble_fraction:.1%}",
           f"memory per GPU: {p.memory_bytes / 1e9:.1f} GB of {p.capacity_bytes / 1e9:.1f}: " + ("fits" if p.fits else f"does not fit ({p.why})")]
    out += [f"  {k}: {v / 1e9:.2f} GB" for k, v in p.memory.items()]
    out.append(f"step: {p.step_seconds:.2f} s; {p.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {p.mfu:.1%}, {p.days:.1f} days")
    out += [f"  {k}: {v:.3f} s" for k, v in p.time.items()]
    out.append("communication before overlap: " + ", ".join(f"{k} {v:.2f} s" for k, v in p.traffic.items()))
    if plan.best and plan.best.layout != p.layout:
        out.append(f"the best layout, {plan.best.layout}, is predicted at {plan.best.step_seconds:.2f} s per step "
                   f"({p.step_seconds / plan.best.step_seconds:.2f}x)")
    return "\n".join(out)


def chart(plan: Plan, path: Path, top: int = 10) -> Path:
    """A bar per layout, its step time split into the terms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = shown(plan, top)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 2.0))
    labels = [f"{label}: {p.layout}" for label, p in rows]
    left = [0.0] * len(rows)
    for term in TIME_TERMS:
        widths = [p.time[term] for _, p in rows]
        ax.barh(labels, widths, left=left, label=term)
        left = [a + b for a, b in zip(left, widths)]
    for y, (_, p) in enumerate(rows):
        ax.text(left[y], y, f" {p.tflops_per_gpu:.0f} TFLOP/s", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.15)  # room for the TFLOP/s labels
    ax.set_xlabel("predicted seconds per step")
    ax.set_title(f"OPT-{plan.work.model.name} on {plan.cluster.gpus} x {plan.cluster.gpu.name}", fontsize=10)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=len(TIME_TERMS), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (0.45 * len(rows) + 2.0), 1, 1))  # the legend below
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- zero_stage: auto


def zero_stage_for(key: str, section: EngineConfig, seq_len: int, total_tokens: float, recompute: bool) -> int:
    """The ZeRO stage `auto` stands for in a training section (train, screen.proxy): the lowest that the training
    stage takes for the section's layout and precision (train/rules.py layout_rule) and, on GPUs, that the cost model
    predicts fits in the GPU's memory (train/plan/layout.py; the GPU as `startup_check` finds it: cluster.yaml's GPU
    workers). Lowest, not fastest: the model prices the stages within a fraction of a percent of each other, and
    what it does not price, DeepSpeed's work per micro-batch and its reads of the device, grows with the stage
    (docs/benchmarks.md, "The training step's host reads and ZeRO-0 on CPU"). On CPU there is no memory model of
    the host: the lowest stage the layout takes. `recompute`: the section's activation checkpointing (the screen's
    proxies have none). `section.zero_stage` is left as it is; raises ConfigError naming `key`.zero_stage when no
    stage can be chosen."""
    tp, pp = section.parallel.tensor, section.parallel.pipeline
    taken = [z for z in (0, 1, 2, 3)
             if layout_rule(tp, pp, z, section.precision) is None and not (section.compile and compile_rule(tp, pp, z))]
    if not taken:
        raise ConfigError(f"{key}.zero_stage", f"no ZeRO stage takes tensor {tp}, pipeline {pp} in {section.precision}")
    if section.gpus_per_worker < 1:
        return taken[0]
    if section.precision not in ("bf16", "fp16"):
        raise ConfigError(f"{key}.zero_stage", f"auto on GPUs needs bf16 or fp16, which the layout planner prices; "
                          f"got {section.precision}: give the stage, 0 to 3")
    try:
        work, cluster, _ = workload(parse_args([]), section, seq_len, total_tokens)
    except ConfigError as exc:
        raise ConfigError(f"{key}.zero_stage", f"auto needs the GPU the planner prices ({exc}); give the stage, "
                          "0 to 3") from None
    tried = []
    for zero in taken:
        layout = Layout(tp, pp, cluster.gpus // (tp * pp), zero, section.micro_batch_size,
                        "full" if recompute else "none")
        if problem(layout, work, cluster) or refused_here(layout, work):
            continue
        prediction = predict(layout, work, cluster)
        if prediction.fits:
            return zero
        tried.append(f"ZeRO-{zero} {prediction.memory_bytes / 1e9:.1f} GB")
    raise ConfigError(f"{key}.zero_stage", f"auto: no stage fits in {cluster.gpu.name}'s "
                      f"{cluster.gpu.memory_bytes / 1e9:.1f} GB "
                      f"({', '.join(tried) or 'none priced'}); see `{PLAN_COMMAND}` for a layout that does")


# --------------------------------------------------------------------------- the pipeline's check


def startup_check(train: TrainConfig, seq_len: int, config_path: str | None, force: bool, out_dir: Path) -> list[Path]:
    """Before GPU training: price the configured layout against the best, write the plan to out_dir.

    Prints one warning when the configured layout is predicted more than SLOWER_WARNING times slower
    than the best; raises ConfigError when it is predicted not to fit, unless forced. Returns the files
    written (plan.md, plan.json, plan.png) for the pipeline's MLflow run. Nothing on CPU.
    """
    if train.gpus_per_worker < 1 or train.precision not in ("bf16", "fp16"):
        return []
    plan = make_plan(*inputs(parse_args([]), train, seq_len))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "plan.md", out_dir / "plan.json"]
    files[0].write_text(report(plan) + "\n")
    files[1].write_text(json.dumps([p.as_dict() for p in plan.ranked[:50]], indent=1))
    if plan.ranked:
        files.append(chart(plan, out_dir / "plan.png"))
    command = f"{PLAN_COMMAND} --config {config_path}" if config_path else PLAN_COMMAND
    mine = plan.configured
    if mine is not None and not mine.fits and not force:
        raise ConfigError("train", f"the configured layout {mine.layout} is predicted not to fit: {mine.why}; "
                          f"see `{command}`, or pass --force-layout to run it anyway")
    slowdown = plan.slowdown()
    if slowdown is not None and slowdown > SLOWER_WARNING:
        print(f"warning: training's layout {mine.layout} ({mine.tflops_per_gpu:.0f} TFLOP/s per GPU) is predicted "
              f"{slowdown:.1f}x slower than {plan.best.layout} ({plan.best.tflops_per_gpu:.0f}) on {plan.cluster.gpus} x "
              f"{plan.cluster.gpu.name}; see why with `{command}`", file=sys.stderr)
    return files


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as the pipeline's own errors
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = _Parser(prog=PLAN_COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help=f"the pipeline config whose model, batch and train.* are planned (default: {DEFAULT_CONFIG.relative_to(ROOT)})")
    p.add_argument("--model", help="an OPT size from model/configs.py (default: the config's train.model)")
    p.add_argument("--gpus", type=int, help="GPUs in all (default: train.num_workers x train.gpus_per_worker)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU (default: the node type's)")
    p.add_argument("--gpus-per-node", type=int, help="default: the node type's, or 8")
    p.add_argument("--node", help=f"a node type: {', '.join(NODES)} (default: cluster.yaml's GPU workers)")
    p.add_argument("--intra-gbps", type=float, help="NVLink per node, Gb/s per direction (default: the GPU's x GPUs per node)")
    p.add_argument("--inter-gbps", type=float, help="network between nodes per node, Gb/s (8 x 200 Gb/s InfiniBand: 1600; a p4de's EFA: 400)")
    p.add_argument("--batch-tokens", type=int, help="global batch in tokens (default: the config's)")
    p.add_argument("--seq-len", type=int, help="default: the config's tokenize.seq_len")
    p.add_argument("--precision", choices=["bf16", "fp16"], help="default: the config's train.precision")
    p.add_argument("--layout", help="price this one layout: tp=8,pp=4,zero=1[,mb=1][,recompute=full]")
    p.add_argument("--json", action="store_true", help="print the layouts as a JSON list instead of tables")
    p.add_argument("--png", type=Path, help="also draw the step-time terms of the layouts shown as a bar chart here")
    p.add_argument("--top", type=int, default=10, help="layouts shown in the table (default 10; --json lists all that fit)")
    for action in p._actions:
        if action.type in (int, float) and action.dest != "top":
            action.type = _positive(action.type, action.option_strings[0])
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def _positive(kind, flag: str):
    def convert(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be positive, got {text}")
        return value
    return convert
