"""The cost of one parallel layout: memory per GPU and time per step, term by term.

A layout splits the GPUs into tensor (tp, inside a node) x pipeline (pp) x data (dp) parallel groups,
with a ZeRO stage over the data-parallel group, a micro batch and an activation-recompute policy.
`predict` prices it on a cluster for a workload; `train/plan/planner.py` enumerates and ranks layouts.

The model, in the order of `predict`:

- Memory, on the pipeline stage that needs most (the first holds the embedding and the most
  micro-batches in flight; the last the tied output layer and the logits): the weights, gradients and
  optimizer states that DeepSpeed's optimizer for the precision and ZeRO stage holds at its peak, inside
  the optimizer's step (`state_bytes`, per parameter: measured on real engines by tests/test_parallel.py),
  each divided by tp and pp. Activations per
  layer per micro-batch follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198), tensor parallel without sequence parallelism, for OPT's ReLU:
  s*b*h*(10 + 16/t) bytes (their 24/t is for GeLU, which keeps its input and fc2 its output; ReLU's
  backward reads its output, the tensor fc2 keeps anyway) plus 5*a*s^2*b/t for the attention scores,
  which a fused attention kernel (ours: torch's scaled_dot_product_attention) never stores. What torch
  saves for a block on the meta device with CUDA's kernels (flash attention, dropout's bool masks) is
  this within 1% (tests/test_plan.py::test_meta_stage_matches_planner). Full recompute keeps each layer's input
  (2*s*b*h) and rebuilds one layer at a time. 1F1B keeps pp - i micro-batches in flight on stage i.
- Compute: model FLOPs (model.configs.flops_per_token: 6 per parameter per token plus attention),
  plus the forward again under full recompute, at ACHIEVABLE_FRACTION of the GPU's dense peak.
- Communication, each collective as a ring (all-reduce moves 2(n-1)/n of its bytes per GPU,
  all-gather and reduce-scatter (n-1)/n) at BUS_EFFICIENCY of the link: tensor-parallel all-reduces
  on NVLink on the critical path; pipeline sends of each micro-batch's activations and gradients;
  data-parallel gradients (and ZeRO-3's parameter gathers) at each GPU's share of its node's network
  when the group spans nodes. ZeRO-3 and ZeRO-2 communicate every micro-batch, ZeRO 0-1 once per step.
  Overlap: ZeRO-3's gathers and reduce-scatters hide behind the micro-batch's compute (prefetch),
  ZeRO 0-2's gradient reductions behind the backward pass in which they happen; with a pipeline
  nothing is hidden (DeepSpeed's pipeline engine reduces after the last micro-batch).
- Pipeline bubble: (pp - 1) micro-batch slots of the slowest stage, (pp - 1) / (m + pp - 1) of the
  step for m micro-batches.

Why each GPU's share of the node's network, and not the node's whole bandwidth per collective: a
ring over a flat group crosses each node boundary once per channel, so in theory the node's cards
together carry one copy of the data; measured ZeRO-3 training of 175B and 530B models (Narayanan et
al. 2021, Table 2) matches the per-GPU form in all six rows and the per-node form in none (it would
predict over 100 TFLOP/s where 44 was measured). tests/test_plan.py reproduces that table.
"""

from __future__ import annotations

from dataclasses import dataclass

from train.rules import layout_rule
from model.configs import OPTConfig, block_params, flops_per_token
from train.plan.hardware import GPU
from train.rules import tensor_only_problem

# The fraction of dense peak that the model's matmuls and kernels reach on one GPU, with no communication
# and no bubble. Narayanan et al. 2021 (arXiv 2104.04473), Table 1: 44-52% of peak end to end for 145B-1T
# GPT models on A100s, which includes their pipeline bubble and tensor-parallel all-reduces (6-12% of
# the step by this model); without them, ~55%. On a lent GPU bench_train.py measures it: a single-GPU
# step has neither, so its MFU is this constant (docs/benchmarks.md, "The layout planner").
ACHIEVABLE_FRACTION = 0.55
# NCCL's bus bandwidth for large messages as a fraction of the link's line rate (nccl-tests on NVLink and
# InfiniBand/EFA reach 80-90%): an assumption, not a measurement of ours.
BUS_EFFICIENCY = 0.85
# The fraction of a window of compute that communication scheduled beside it can hide: NCCL's kernels take
# SMs from the matmuls they run beside, and a pass's first gather and last reduce-scatter have nothing to
# hide behind. Fitted, and the one constant that is: of 0.7, 0.85 and 1.0, 0.7 matches the ZeRO-3 rows of
# Narayanan et al.'s Table 2 best (175B: ratios to the published 1.00, 0.94, 1.01); every value in that
# range keeps them within 30%, and the conclusion (ZeRO-3 alone loses two thirds of its throughput from
# 384 to 1,536 GPUs) holds for all of them.
OVERLAP = 0.7
RESERVED_BYTES = 2e9  # CUDA context, NCCL's buffers for a few communicators, cuBLAS workspaces
FRAGMENTATION = 0.10  # the caching allocator's slack over what is live
LOGIT_BYTES = 10  # per logit: fp16/bf16 (2) + the fp32 copy the loss takes (4) + its fp32 gradient (4)
ACTIVATION_BYTES = 2  # fp16/bf16
ADAM_TRAFFIC_BYTES = 34  # HBM bytes per owned parameter per step: read 16 + write 12 of fp32 state, the fp16 copy
RECOMPUTE = ("none", "selective", "full")


class LayoutError(ValueError):
    """A layout that cannot run at all (not one that runs out of memory: that is Prediction.fits)."""


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int
    intra_gbps: float  # per node, per direction: NVLink, Gb/s (8 A100s: 8 x 2400)
    inter_gbps: float  # per node, per direction: EFA or InfiniBand, Gb/s

    @property
    def intra_bytes_s(self) -> float:
        """One GPU's NVLink, bytes/s."""
        return self.intra_gbps * 1e9 / 8 / self.gpus_per_node

    @property
    def inter_bytes_s(self) -> float:
        """One GPU's share of the node's network, bytes/s: every GPU of a node communicates at once."""
        return self.inter_gbps * 1e9 / 8 / self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    model: OPTConfig
    seq_len: int
    batch_seqs: int  # global batch, in sequences
    precision: str  # bf16 | fp16
    total_tokens: float
    fused_attention: bool = True  # attention scores never stored (model/opt.py's scaled_dot_product_attention)

    @property
    def batch_tokens(self) -> int:
        return self.batch_seqs * self.seq_len


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int
    recompute: str  # none | selective | full

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp},zero={self.zero},mb={self.micro_batch},recompute={self.recompute}"


def parse_layout(text: str, gpus: int) -> Layout:
    """'tp=8,pp=4,zero=1[,mb=1][,recompute=full]' on `gpus` GPUs (dp is what is left; given, it must agree)."""
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("tp", "pp", "dp", "zero", "mb", "recompute"):
            raise LayoutError(f"--layout: expected key=value with keys tp, pp, dp, zero, mb, recompute; got {part!r}")
        values[key] = value
    try:
        tp, pp = int(values.get("tp", 1)), int(values.get("pp", 1))
        zero, mb = int(values.get("zero", 1)), int(values.get("mb", 1))
    except ValueError as exc:
        raise LayoutError(f"--layout: {exc}") from None
    recompute = values.get("recompute", "full")
    if min(tp, pp, mb) < 1 or gpus % (tp * pp):
        raise LayoutError(f"--layout {text}: tp x pp = {tp * pp} does not divide the {gpus} GPUs")
    dp = gpus // (tp * pp)
    if "dp" in values and values["dp"] != str(dp):
        raise LayoutError(f"--layout {text}: dp is {gpus} / (tp x pp) = {dp}, not {values['dp']}")
    return Layout(tp, pp, dp, zero, mb, recompute)


def problem(layout: Layout, work: Workload, cluster: Cluster) -> str | None:
    """Why this layout cannot run at all, or None."""
    cfg, (tp, pp, dp) = work.model, (layout.tp, layout.pp, layout.dp)
    if cfg.n_head % tp or cfg.ffn_dim % tp:
        return f"tp={tp} does not divide n_head={cfg.n_head} and ffn_dim={cfg.ffn_dim}"
    if tp > cluster.gpus_per_node:
        return f"tp={tp} spans nodes of {cluster.gpus_per_node} GPUs: its all-reduces, two per layer, would cross the network"
    if pp > cfg.n_layer:
        return f"pp={pp} is more stages than the {cfg.n_layer} layers"
    if tp * pp * dp != cluster.gpus:
        return f"tp x pp x dp = {tp * pp * dp}, not the {cluster.gpus} GPUs"
    if layout.zero not in (0, 1, 2, 3):
        return f"zero={layout.zero}: ZeRO stages are 0-3"
    if pp > 1 and layout.zero > 1:
        return "DeepSpeed's pipeline engine takes ZeRO 0 or 1 (stages 2 and 3 partition the gradients it accumulates)"
    if layout.recompute not in RECOMPUTE:
        return f"recompute={layout.recompute}: expected one of {', '.join(RECOMPUTE)}"
    if layout.recompute == "selective" and work.fused_attention:
        return "selective recompute re-runs attention's softmax, which the fused attention kernel recomputes already"
    if work.batch_seqs % (dp * layout.micro_batch):
        return f"the batch of {work.batch_seqs} sequences does not split into dp={dp} x micro batch {layout.micro_batch}"
    return None


def refused_here(layout: Layout, work: Workload) -> str | None:
    """Why this project's training stage refuses a layout that the cost model can price (Megatron's ZeRO-0
    pipelines, for one), or None: train/rules.py's layout_rule, the rules it applies to train.parallel,
    zero_stage and precision, and train/rules.py's on the models tensor parallelism alone takes."""
    broken = layout_rule(layout.tp, layout.pp, layout.zero, work.precision)
    return broken[1] if broken else tensor_only_problem(work.model, layout.tp, layout.pp)


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # bytes per GPU, by term, on the stage that needs most
    time: dict[str, float]  # seconds per step, by term: they add up to step_seconds
    traffic: dict[str, float]  # seconds of communication per step before any overlap, by kind
    micro_batches: int
    bubble_fraction: float
    step_seconds: float
    tflops_per_gpu: float  # model FLOPs (recompute not counted), as bench_train.py's MFU
    mfu: float
    days: float  # for the workload's total_tokens
    capacity_bytes: float
    stage: int = 0  # the pipeline stage whose memory `memory` is
    why: str | None = None  # why it does not fit

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.why is None

    def as_dict(self) -> dict:
        lay = self.layout
        row = {"layout": str(lay), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero": lay.zero, "micro_batch": lay.micro_batch,
               "recompute": lay.recompute, "micro_batches": self.micro_batches, "memory_gb": round(self.memory_bytes / 1e9, 2),
               "step_seconds": round(self.step_seconds, 3), "tflops_per_gpu": round(self.tflops_per_gpu, 1),
               "mfu": round(self.mfu, 4), "days": round(self.days, 1), "bubble": round(self.bubble_fraction, 4), "fits": self.fits,
               "memory_terms_gb": {k: round(v / 1e9, 3) for k, v in self.memory.items()},
               "time_terms_s": {k: round(v, 3) for k, v in self.time.items()},
               "traffic_s": {k: round(v, 3) for k, v in self.traffic.items()}}
        if self.why:
            row["why"] = self.why
        return row


def gradient_bytes(precision: str, zero: int) -> int:
    """Bytes per gradient element the engine sums and reduces: fp32 for bf16 (train/optim.py: summed in fp32
    under ZeRO >= 1; ZeRO-0's bf16 is autocast over fp32 weights, `autocast_dtype`), fp16's own otherwise."""
    return 4 if precision == "bf16" else 2


def state_bytes(precision: str, zero: int, dp: int) -> dict[str, float]:
    """Bytes per parameter that DeepSpeed 0.19's optimizer holds for the weights, gradients and optimizer
    states at its peak, with `dp` data-parallel ranks: the larger of two moments of a step (Adam's m and v
    made), the end of the backward pass and the end of the optimizer's step. tests/test_parallel.py builds
    each engine on gloo and measures both.

    - bf16, ZeRO-1: BF16_Optimizer (engine._do_optimizer_sanity_check, with fp32 gradient sums). Its fp32
      gradient buffer is whole on every rank (bf16_optimizer.py: fp32_groups_gradients_flat), and the fp32
      gradient of the partition is a view into it; each bf16 gradient is freed once added
      (train/optim.py: immediate_grad_update). Optimizer: the fp32 master partition and m, v.
    - fp16, ZeRO-1 (stage_1_and_2.py): every fp16 gradient is alive at the end of the backward pass; the
      reduction at the boundary frees all but this rank's partition, which the step turns into fp32.
    - ZeRO-2: gradients reduced into partitions as they are made; in bf16 the fp32 sums are the partition's
      gradient the optimizer reads, in fp16 the step makes an fp32 copy.
    - ZeRO-3 (stage3.py): the weights partitioned too, and an fp32 gradient partition made at the step.
    - ZeRO-0, bf16: torch's autocast over fp32 weights and gradients, Adam's m and v (train/optim.py
      `autocast_dtype`), whole. fp16 takes ZeRO 1-3 (train/rules.py)."""
    if zero == 0:
        return {"weights": 4.0, "gradients": 4.0, "optimizer": 8.0}
    weights, width = 2 / dp if zero == 3 else 2.0, gradient_bytes(precision, zero)
    if precision == "bf16":
        grads = width if zero == 1 else width / dp
        backward = {"weights": weights, "gradients": grads, "optimizer": 12 / dp}
        step = {"weights": weights, "gradients": grads, "optimizer": (16 if zero == 3 else 12) / dp}
    else:
        backward = {"weights": weights, "gradients": width if zero == 1 else width / dp, "optimizer": 12 / dp}
        step = {"weights": weights, "gradients": width / dp, "optimizer": 16 / dp}
    return max(backward, step, key=lambda terms: sum(terms.values()))


def ring(n: int, kind: str) -> float:
    """Bytes each GPU sends per byte of the collective's buffer, in a ring of n."""
    return 0.0 if n <= 1 else (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


def stage_layers(n_layer: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as even as they go; the first stages take the remainder."""
    return [n_layer // pp + (1 if i < n_layer % pp else 0) for i in range(pp)]


def activation_bytes(work: Workload, layout: Layout, recompute: str) -> float:
    """Bytes one layer keeps for its backward, per micro-batch (Korthikanti et al. 2022, no sequence parallelism)."""
    cfg, s, b, t = work.model, work.seq_len, layout.micro_batch, layout.tp
    sbh = s * b * cfg.d_model
    if recompute == "full":
        return ACTIVATION_BYTES * sbh  # the layer's input
    # replicated over the tensor group (10): both LayerNorms' inputs, the q/k/v and fc1 inputs, 2 dropout masks
    # (1 byte); split (16): q, k, v and the attention's output (out_proj's input), ReLU's output (fc2's input)
    kept = sbh * (10 + 16 / t)
    if recompute == "none" and not work.fused_attention:
        kept += 5 * cfg.n_head * s * s * b / t  # softmax output, its dropout mask and output
    return kept


@dataclass(frozen=True)
class _Step:
    """What `predict` derives once from a layout, a workload and a cluster, for its terms to share."""

    layout: Layout
    work: Workload
    micro_batches: int  # per step through each pipeline
    block: int  # parameters of one decoder layer
    state: dict[str, float]  # bytes per parameter of this layout's tp x pp share: weights, gradients, optimizer
    rate: float  # FLOP/s one GPU reaches
    sbh_bytes: float  # one micro-batch's activations at a layer boundary
    dp_link: float  # bytes/s of each group's ring
    pp_link: float
    tp_link: float
    stages: dict[int, tuple[int, bool, bool]]  # stage: (layers, holds the embedding, holds the output layer)


def _step(layout: Layout, work: Workload, cluster: Cluster) -> _Step:
    cfg = work.model
    tp, pp, dp, zero, b = layout.tp, layout.pp, layout.dp, layout.zero, layout.micro_batch
    h = cfg.d_model
    # Where each group's ring runs. DeepSpeed's topology orders ranks (pipe, data, model): a tensor group is
    # tp neighbours, a data-parallel group spans tp x dp ranks, and a pipeline spans all of them.
    dp_link = (cluster.intra_bytes_s if tp * dp <= cluster.gpus_per_node else cluster.inter_bytes_s) * BUS_EFFICIENCY
    pp_link = (cluster.intra_bytes_s if tp * dp * pp <= cluster.gpus_per_node else cluster.inter_bytes_s) * BUS_EFFICIENCY
    layers = stage_layers(cfg.n_layer, pp)
    stages = {0: (layers[0], True, pp == 1)}
    stages[pp - 1] = (layers[-1], pp == 1, True)
    return _Step(
        layout, work,
        micro_batches=work.batch_seqs // (dp * b),
        block=block_params(cfg),
        state=state_bytes(work.precision, zero, dp),
        rate=cluster.gpu.peak_tflops(work.precision) * 1e12 * ACHIEVABLE_FRACTION,
        sbh_bytes=ACTIVATION_BYTES * work.seq_len * b * h,
        dp_link=dp_link, pp_link=pp_link, tp_link=cluster.intra_bytes_s * BUS_EFFICIENCY,
        stages=stages)


def _params_on(st: _Step, stage: int) -> float:
    """Parameters one GPU of this pipeline stage holds before ZeRO partitions them. The tensor group splits the
    matrices, their column-parallel biases and the token embedding (train/parallel/groups.py: parallelize);
    each block's LayerNorms and row-parallel biases (out_proj, fc2: 6h), the positions and the final LayerNorm
    stay whole on every rank. The first stage holds the positions, the last the tied copy of the tokens."""
    n, first, last = st.stages[stage]
    cfg, tp = st.work.model, st.layout.tp
    h = cfg.d_model
    params = n * ((st.block - 6 * h) / tp + 6 * h)
    params += cfg.vocab_size * h / tp if first or last else 0
    params += (cfg.max_seq_len + 2) * h if first else 0
    return params + (2 * h if last and cfg.pre_ln else 0)


def stage_params(layout: Layout, work: Workload, cluster: Cluster) -> dict[int, float]:
    """Parameters one GPU holds on the first and the last pipeline stage (the ones that hold most)."""
    st = _step(layout, work, cluster)
    return {stage: _params_on(st, stage) for stage in st.stages}


def _memory_of(st: _Step, stage: int) -> dict[str, float]:
    """Bytes per GPU on this pipeline stage, by term."""
    layout, work, cfg = st.layout, st.work, st.work.model
    tp, pp, zero = layout.tp, layout.pp, layout.zero
    n, _, last = st.stages[stage]
    params = _params_on(st, stage)
    in_flight = min(pp - stage, st.micro_batches)
    h, full = cfg.d_model, layout.recompute == "full"
    terms = {
        **{term: per_param * params for term, per_param in st.state.items()},
        # ZeRO-3's working set, as DeepSpeed's estimator counts it: the largest module's gathered fp16
        # weights and gradient (4 B per parameter); ours is fc1 (or fc2), d_model x ffn_dim
        "gathered module": 4 * (h * cfg.ffn_dim + cfg.ffn_dim) / tp if zero == 3 else 0.0,
        "activations": in_flight * n * activation_bytes(work, layout, layout.recompute)
        + (activation_bytes(work, layout, "none") if full else 0.0),
        "logits": work.seq_len * layout.micro_batch * cfg.vocab_size / tp * LOGIT_BYTES if last else 0.0,
    }
    terms["allocator margin"] = FRAGMENTATION * sum(terms.values()) + RESERVED_BYTES
    return terms


def _micro_batch_times(st: _Step, stage: int) -> dict[str, float]:
    """Seconds of one micro-batch (forward and backward) on this stage, by term."""
    layout, cfg = st.layout, st.work.model
    tp, pp, s, h = layout.tp, layout.pp, st.work.seq_len, cfg.d_model
    n, first, last = st.stages[stage]
    tokens = s * layout.micro_batch
    layer_fpt = 6 * st.block + 12 * h * s  # per layer, as flops_per_token counts it
    extra_fpt = {"none": 0, "selective": 4 * h * s, "full": 2 * st.block + 4 * h * s}[layout.recompute]
    head_fpt = 6 * cfg.vocab_size * h if last else 0
    compute = tokens * (n * (layer_fpt + extra_fpt) + head_fpt) / tp / st.rate
    backward = tokens * (n * layer_fpt + head_fpt) * (2 / 3) / tp / st.rate
    # Megatron's column/row split: two all-reduces of the layer's activations forward, two backward, two
    # more when the forward is recomputed; the vocabulary-parallel embedding and output layer one each.
    all_reduces = n * (6 if layout.recompute == "full" else 4) + first + last
    tensor = all_reduces * ring(tp, "all-reduce") * st.sbh_bytes / st.tp_link
    # Each rank of the tensor group sends the whole activation (no scatter/gather in DeepSpeed's engine),
    # forward, and its gradient back.
    pipeline = 2 * st.sbh_bytes / st.pp_link if pp > 1 else 0.0
    return {"compute": compute, "backward": backward, "tensor parallel": tensor, "pipeline sends": pipeline}


def _data_parallel(st: _Step, params: float, per_mb: dict[str, float]) -> tuple[float, float, float, float]:
    """Seconds of data-parallel communication per step, on the largest stage's parameters: (reduce once per
    step, gather once per step, every micro-batch, what is left exposed after overlap)."""
    dp, zero, m = st.layout.dp, st.layout.zero, st.micro_batches
    grads, weights = gradient_bytes(st.work.precision, zero) * params, 2 * params
    if zero == 0:
        reduce_step, gather_step, every_mb = ring(dp, "all-reduce") * grads, 0.0, 0.0
    elif zero == 1 and st.work.precision == "bf16":
        # BF16_Optimizer all-reduces its whole fp32 gradient buffer (engine.allreduce_gradients ->
        # buffered_allreduce_fallback; pipe/engine.py _bf16_reduce_grads), then gathers the bf16 weights
        reduce_step, gather_step, every_mb = ring(dp, "all-reduce") * grads, ring(dp, "all-gather") * weights, 0.0
    elif zero == 1:
        reduce_step, gather_step, every_mb = ring(dp, "reduce-scatter") * grads, ring(dp, "all-gather") * weights, 0.0
    elif zero == 2:
        reduce_step, gather_step, every_mb = 0.0, ring(dp, "all-gather") * weights, ring(dp, "reduce-scatter") * grads
    else:  # weights gathered for the forward, the backward and a recomputed forward; gradients reduce-scattered
        reduce_step, gather_step = 0.0, 0.0
        every_mb = (ring(dp, "all-gather") * weights * (3 if st.layout.recompute == "full" else 2)
                    + ring(dp, "reduce-scatter") * grads)
    reduce_step, gather_step, every_mb = reduce_step / st.dp_link, gather_step / st.dp_link, every_mb / st.dp_link
    if st.layout.pp > 1:  # the pipeline engine reduces after its last micro-batch: nothing overlaps
        exposed = reduce_step + gather_step
    elif zero == 3:  # prefetched gathers and reduce-scatters beside each micro-batch's compute
        exposed = m * max(0.0, every_mb - OVERLAP * per_mb["compute"])
    else:  # gradient reduction beside the backward in which it happens; ZeRO 1-2's gather after the step
        exposed = (m * max(0.0, every_mb - OVERLAP * per_mb["backward"])
                   + max(0.0, reduce_step - OVERLAP * per_mb["backward"]) + gather_step)
    return reduce_step, gather_step, every_mb, exposed


def _why_not_fits(memory: dict[str, float], capacity: float) -> str | None:
    total = sum(memory.values())
    if total <= capacity:
        return None
    name = max((k for k in memory if k != "allocator margin"), key=memory.get)
    return f"needs {total / 1e9:.1f} GB of the GPU's {capacity / 1e9:.1f} GB; {name}: {memory[name] / 1e9:.1f} GB"


def predict(layout: Layout, work: Workload, cluster: Cluster) -> Prediction:
    reason = problem(layout, work, cluster)
    if reason:
        raise LayoutError(f"{layout}: {reason}")
    st = _step(layout, work, cluster)
    gpu, pp, dp, zero, m = cluster.gpu, layout.pp, layout.dp, layout.zero, st.micro_batches
    memories = {i: _memory_of(st, i) for i in st.stages}
    stage = max(memories, key=lambda i: sum(memories[i].values()))
    memory = memories[stage]
    per_mb = max((_micro_batch_times(st, i) for i in st.stages),
                 key=lambda t: t["compute"] + t["tensor parallel"] + t["pipeline sends"])
    slot = per_mb["compute"] + per_mb["tensor parallel"] + per_mb["pipeline sends"]
    params = max(_params_on(st, i) for i in st.stages)
    reduce_step, gather_step, every_mb, dp_exposed = _data_parallel(st, params, per_mb)
    owned = params / (dp if zero >= 1 else 1)
    time = {
        "compute": m * per_mb["compute"],
        "tensor parallel": m * per_mb["tensor parallel"],
        "pipeline sends": m * per_mb["pipeline sends"],
        "pipeline bubble": (pp - 1) * slot,
        "data parallel": dp_exposed,
        "optimizer": owned * ADAM_TRAFFIC_BYTES / gpu.hbm_bytes_s,
    }
    step = sum(time.values())
    traffic = {"tensor parallel": time["tensor parallel"], "pipeline sends": time["pipeline sends"],
               "data parallel": reduce_step + gather_step + m * every_mb}
    tflops = flops_per_token(work.model, work.seq_len) * work.batch_tokens / step / cluster.gpus / 1e12
    return Prediction(layout, memory, time, traffic, m, (pp - 1) / (m + pp - 1), step, tflops,
                      tflops / gpu.peak_tflops(work.precision), work.total_tokens / work.batch_tokens * step / 86400,
                      gpu.memory_bytes, stage, _why_not_fits(memory, gpu.memory_bytes))
