"""What the first GPU run would hit, tested on this CPU wherever DeepSpeed allows: DeepSpeed's real
fp16 loss scaler (its fp16 check lifted by the deepspeed_rank fixture: train/cpu_fp16.py), a ZeRO-3 model built
partitioned under `deepspeed.zero.Init`, and collectives on the process group's own device. The
GPU itself: benchmarks/gpu_check.py."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import ROOT
from model.configs import get
from model.opt import OPT
from train.optim import INITIAL_SCALE_POWER, adamw, deepspeed_config, param_groups


def engine_for(zero_stage: int, precision: str, model: torch.nn.Module | None = None):
    import deepspeed

    torch.manual_seed(0)
    model = model if model is not None else OPT(get("tiny"))
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model, 1e-3, 0.1), config=deepspeed_config(
        micro_batch=2, accumulation=1, world_size=1, zero_stage=zero_stage, precision=precision, grad_clip=1.0))
    return engine


def step(engine, seed: int, overflow: bool = False) -> None:
    """One training step; `overflow`: the loop's injected overflow (the scaled loss times 1e38 is inf in fp16)."""
    ids = torch.randint(4, 512, (2, 17), generator=torch.Generator().manual_seed(seed))
    loss = engine(ids[:, :-1], ids[:, 1:])
    engine.backward(loss * 1e38 if overflow else loss)
    engine.step()


def eval_loss(engine) -> float:
    """The loss on a fixed batch without dropout: it moves when the weights do (ZeRO-3 gathers them itself)."""
    ids = torch.randint(4, 512, (2, 17), generator=torch.Generator().manual_seed(7))
    engine.eval()
    with torch.no_grad():
        loss = engine(ids[:, :-1], ids[:, 1:]).item()
    engine.train()
    return loss


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_the_autopilot_sees_the_loss_scale_collapse_before_deepspeed_gives_up_and_a_reset_takes(
        deepspeed_rank, torch_fp16, zero_stage):
    from train.config import AutopilotConfig
    from train.autopilot_policy import Detectors
    from train.loop.pilot import loss_scale, reset_loss_scale

    engine = engine_for(zero_stage, "fp16")
    floor = AutopilotConfig().scale_floor
    assert loss_scale(engine) == 2.0 ** INITIAL_SCALE_POWER and floor == 2.0
    overflows = 0
    while loss_scale(engine) >= floor:
        step(engine, overflows, overflow=True)
        overflows += 1
        assert overflows < 40
    assert loss_scale(engine) == 1.0 and engine.skipped_steps == overflows  # DeepSpeed's minimum, no exception
    seen = Detectors(AutopilotConfig()).observe(overflows, {"loss": 5.0, "grad_norm": None, "loss_scale": 1.0,
                                                            "fp16": True, "overflow": True, "activation_norm": 1.0})
    assert seen is not None and seen.kind == "loss_scale_collapse"  # the loop acts at the end of this very step
    before, after = reset_loss_scale(engine)
    assert (before, after) == (1.0, 2.0 ** INITIAL_SCALE_POWER) and loss_scale(engine) == after
    step(engine, 100, overflow=True)  # hysteresis refilled: one overflow does not halve the fresh scale at once
    assert loss_scale(engine) == 2.0 ** INITIAL_SCALE_POWER and engine.skipped_steps == overflows + 1
    before_step = eval_loss(engine)
    step(engine, 101)  # a clean step is taken, not skipped
    assert engine.skipped_steps == overflows + 1 and eval_loss(engine) != before_step
    # What the floor is for: left at DeepSpeed's minimum, the next overflows end the run.
    with pytest.raises(Exception, match="Current loss scale already at minimum"):
        for i in range(40):
            step(engine, 200 + i, overflow=True)
    engine.destroy()


def test_an_fp16_floor_at_deepspeeds_minimum_is_refused_at_load():
    from core.config import ConfigError
    from pipelines.config import load_config

    with pytest.raises(ConfigError, match=r"'train.autopilot.scale_floor': expected more than 1, DeepSpeed's minimum"):
        load_config(ROOT / "configs" / "opt-125m.yaml", ["train.autopilot.scale_floor=1.0"])


def test_fp16_on_zero_0_is_refused_at_load():
    from core.config import ConfigError
    from pipelines.config import load_config

    with pytest.raises(ConfigError, match="'train.zero_stage': fp16 needs zero_stage 1, 2 or 3"):
        load_config(ROOT / "configs" / "opt-125m.yaml", ["train.zero_stage=0"])


def test_a_zero3_model_is_built_partitioned_with_opts_init_and_decay_groups(deepspeed_rank):
    """Under zero.Init no process holds a module whole; OPT's init is drawn on each rank's partition and the
    weight-decay groups go by each parameter's real shape (a partitioned placeholder is 1-D)."""
    from train.build import build, is_partitioned, shape_of

    config = get("tiny").replace(d_model=128, n_head=4, vocab_size=2048)  # enough values for the statistics
    ds_config = deepspeed_config(micro_batch=2, accumulation=1, world_size=1, zero_stage=3, precision="fp32", grad_clip=1.0)
    model = build(config, ds_config, seed=0, rank=0)
    whole = OPT(config)
    params = dict(model.named_parameters())
    assert params and all(is_partitioned(p) and p.numel() == 0 for p in params.values())  # placeholders only
    assert {n: tuple(shape_of(p)) for n, p in params.items()} == {n: tuple(p.shape) for n, p in whole.named_parameters()}
    std = config.init_std
    for name, p in params.items():
        part = p.ds_tensor[: p.ds_numel].float()  # this rank's partition, without its padding
        if "layer_norm" in name:
            assert torch.all(part == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("bias"):
            assert torch.all(part == 0.0), name
        else:
            want = std / math.sqrt(2 * config.n_layer) if name.endswith(("out_proj.weight", "fc2.weight")) else std
            assert part.mean().abs() < 4 * want / math.sqrt(part.numel()) and part.std() == pytest.approx(want, rel=0.05), name
    ours = {id(p): n for n, p in model.named_parameters()}
    groups = [{ours[id(p)] for p in g["params"]} for g in param_groups(model, 0.1)]
    ref = {id(p): n for n, p in whole.named_parameters()}
    assert groups == [{ref[id(p)] for p in g["params"]} for g in param_groups(whole, 0.1)]
    assert all(n.endswith("bias") or "layer_norm" in n for n in groups[1]) and groups[0] and groups[1]
    engine = engine_for(3, "fp32", model=model)  # and it trains
    losses = []
    for i in range(3):
        ids = torch.randint(4, 2048, (2, 17), generator=torch.Generator().manual_seed(0))
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[2] < losses[0]
    engine.destroy()


def test_collectives_run_on_the_process_groups_device_and_nothing_else_calls_torch_distributed(deepspeed_rank):
    """NCCL takes CUDA tensors only: every collective of ours makes its tensors on `collectives.device()`,
    and no other module of the project calls a torch.distributed collective with a tensor of its own."""
    from train.parallel import collectives

    assert collectives.backend() == "gloo" and collectives.device() == torch.device("cpu")
    assert collectives.all_mean([2.0, torch.tensor(3.0), torch.tensor([4.0])]) == [2.0, 3.0, 4.0]
    assert collectives.all_ok(True) and not collectives.all_ok(False)
    calls = re.compile(r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|reduce\w*|barrier|gather|scatter|send|recv)\(")
    # Tensor and pipeline parallelism's collectives move the model's own activations, gradients and weights,
    # which are on its device already; those modules make no tensor but with *_like or on another tensor's
    # device (or, in the export's skeleton, an explicitly host one). The placement probe gathers Python objects.
    model_tensors = {f"train/parallel/{name}.py" for name in ("tensor", "groups", "pipeline", "placement")}
    offenders = [f"{path.relative_to(ROOT)}:{i}"
                 for folder in ("train", "screen", "model", "core", "pipelines", "corpus", "dedup")
                 for path in (ROOT / folder).rglob("*.py")
                 if path.name != "collectives.py" and str(path.relative_to(ROOT)) not in model_tensors
                 for i, line in enumerate(path.read_text().splitlines(), 1) if calls.search(line)]
    assert offenders == []
    made = re.compile(r"torch\.(tensor|zeros|ones|empty|full|arange|randn?)\((?!.*device=)")
    for name in model_tensors:
        lines = (ROOT / name).read_text().splitlines()
        assert [line for line in lines if made.search(line)] == [], name


def test_a_zero_0_bf16_engine_computes_its_forward_in_bf16_under_a_gpus_autocast_too(deepspeed_rank, monkeypatch):
    """bf16 at ZeRO-0 is an fp32 engine whose forward computes in bf16 (train/optim.py deepspeed_config). DeepSpeed's
    engine turns off an autocast entered around it unless its own `torch_autocast` section is on, and it asks
    `torch.is_autocast_enabled()`, which answers for CUDA alone: on an H200 the forward ran in fp32 (4x slower at
    125M), while this CPU's autocast went unseen. Here that question answers for the CPU, as it does for the GPU
    there. The loop calls the engine with no autocast of its own; both calls must compute in bf16."""
    engine = engine_for(0, "bf16")
    computed = []
    linear = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, inputs, output: computed.append(output.dtype))
    ids = torch.randint(4, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        engine(ids[:, :-1], ids[:, 1:])  # the loop's call
        asked = torch.is_autocast_enabled
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: asked(device_type or "cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # one around it, seen as a GPU's would be
            engine(ids[:, :-1], ids[:, 1:])
    weights = {p.dtype for p in engine.module.parameters()}
    engine.destroy()
    assert computed == [torch.bfloat16, torch.bfloat16] and weights == {torch.float32}


def test_bf16_zero_accumulates_gradients_in_fp32_and_mfu_knows_each_h100():
    from train.plan.hardware import peak_for

    assert deepspeed_config(micro_batch=1, accumulation=8, world_size=8, zero_stage=1, precision="bf16",
                            grad_clip=1.0)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(micro_batch=1, accumulation=8, world_size=8, zero_stage=0,
                                                precision="bf16", grad_clip=1.0)  # an fp32 engine there (autocast)
    assert peak_for("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_for("NVIDIA H100 PCIe", "bf16") == 756.0 and peak_for("NVIDIA H100 NVL", "bf16") == 835.0
    assert peak_for("NVIDIA H200", "fp16") == 989.0 and peak_for("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_for("NVIDIA GeForce RTX 4090", "bf16") is None


def test_the_gpu_check_passes_its_dry_run(torch_fp16, gpu_check_run):
    """benchmarks/gpu_check.py, the first command a session with a GPU runs, end to end on this CPU at tiny
    scale (the train stage in bf16 with ZeRO-3 and its export to transformers, an fp16 overflow burst on
    DeepSpeed's real scaler, a kill and resume, bench_train), so that it works when a GPU comes: run as the docs
    give it (`gpu_check.py --dry-run`), in the background (tests/conftest.py's gpu_check_run)."""
    import json

    verdicts = json.loads((gpu_check_run / "verdicts.json").read_text())
    assert [v["check"][:2] for v in verdicts] == ["1.", "2.", "3.", "4."] and all(v["ok"] for v in verdicts), verdicts


def test_gap_attrib_passes_its_dry_run(deepspeed_rank, tmp_path):
    """benchmarks/gap_attrib.py, which a session with a GPU runs before the GPU check, on this CPU at tiny scale:
    every variant measured and written down, and our step now reading the device no more than the bare loop
    (the profiler's `_local_scalar_dense`: the step's one `tolist()` is no op, on a GPU it shows as a copy)."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gap_attrib

    rows = gap_attrib.main(["--dry-run", "--out", str(tmp_path)])
    assert [r.variant for r in rows] == ["bare pure", "bare fair", "ours before", "timers off", "fused AdamW",
                                         "ZeRO-0 autocast", "compiled blocks"]
    reads = {r.variant: r.host_reads for r in rows}
    assert reads["compiled blocks"] == reads["ZeRO-0 autocast"] == reads["bare fair"] == 0 < reads["fused AdamW"] < \
        reads["ours before"], reads
    assert all(r.step_seconds > 0 and r.mfu is None for r in rows)
    assert json.loads((tmp_path / "gap_attrib.json").read_text())[-1]["variant"] == "compiled blocks"


def test_the_gpu_checks_resume_point_is_the_checkpoint_published_before_the_kill(tmp_path):
    """Check 3 on the records a GPU left (2026-11-25, an H100): the save of step 10 was still being written
    when the worker was killed at 15, so the run resumed from step 0 and ran 1-14 twice. That passes, and
    says so; a resume from after the kill, or repeated steps that do not match, fail."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    def run(resumed: int, repeated: list[int], drift: float = 0.0) -> gpu_check.Verdict:
        rows = [{"step": k, "loss": 5.0 - k / 100, "loss_scale": 1.0} for k in range(1, 15)]
        rows += [{"step": k, "loss": 5.0 - k / 100 + drift, "loss_scale": 1.0} for k in repeated]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        incidents = ["injected kill on rank 0", f"resumed from step-{resumed:08d}"]
        (tmp_path / "incidents.jsonl").write_text("".join(json.dumps({"what": w}) + "\n" for w in incidents))
        return gpu_check.check_kill_resume(tmp_path, gpu_check.SETUPS["cuda"], 1.0)

    lost = run(0, list(range(1, 15)))
    assert lost.ok and "the save of step 10 was still being written: lost" in lost.detail, lost
    assert run(10, list(range(11, 15))).ok
    assert not run(10, list(range(11, 15)), drift=0.1).ok  # the repeated steps drew other numbers
    assert not run(10, list(range(1, 15))).ok  # the steps run twice are not the ones after the resume point
    assert not run(20, []).ok  # a checkpoint from after the kill
