"""Checkpoints with real DeepSpeed in this process (one rank, gloo): complete or invisible, verified on
load with a fallback, pruned to the last K plus the healthy ones; and OPT's optimizer and schedule."""

from __future__ import annotations

import json
import logging
import os
import re
import threading

import pytest
import torch

from model.configs import get
from model.opt import OPT
from train import checkpoint_files
from train.optim import adamw, autocast_dtype, deepspeed_config, param_groups
from train.schedule import Schedule
from train.parallel.pipeline import TIED


@pytest.fixture(scope="module")
def engine_factory(deepspeed_rank):
    import deepspeed

    engines = []

    def make(seed: int = 0):
        torch.manual_seed(seed)
        model = OPT(get("tiny"))
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model, 1e-3, 0.1), config=deepspeed_config(
            micro_batch=2, accumulation=1, world_size=1, zero_stage=2, precision="fp32", grad_clip=1.0))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()


def train_step(engine, seed: int) -> None:
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()


def weights(engine) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


def test_save_verify_fall_back_and_prune(engine_factory, tmp_path, caplog):
    engine = engine_factory()
    saved = {}
    for step in (1, 2, 3):
        train_step(engine, step)
        path = checkpoint_files.save(engine, tmp_path, step, {"loader": {"epoch": 0, "step": step}, "health": {"healthy": step == 1}}).wait()
        saved[step] = weights(engine)
        assert path.name == f"step-{step:08d}" and checkpoint_files.verify(path) is None
    meta = checkpoint_files.read_meta(tmp_path / "step-00000003")
    assert meta["step"] == 3 and meta["loader"] == {"epoch": 0, "step": 3} and meta["world_size"] == 1
    assert any(name.startswith("ds/") for name in meta["files"]) and "rng-rank00000.pt" in meta["files"]
    # Every file is listed with the rank that wrote and hashed it: here rank 0, DeepSpeed's `latest` and
    # recovery script (written past its checkpoint engine) too.
    on_disk = {str(p.relative_to(tmp_path / "step-00000003")) for p in (tmp_path / "step-00000003").rglob("*")
               if p.is_file() and p.name != "meta.json"}
    assert set(meta["files"]) == on_disk and {owner for _, _, owner in meta["files"].values()} == {0}
    (tmp_path / ".tmp-step-00000004").mkdir()  # a save that died before its publish: never read

    # Corrupt the newest: one byte of DeepSpeed's model file.
    model_file = next(p for p in (tmp_path / "step-00000003" / "ds").iterdir() if "model_states" in p.name)
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    skipped = []
    fresh = engine_factory(seed=1)
    with caplog.at_level(logging.WARNING):
        loaded = checkpoint_files.load_latest(fresh, tmp_path, on_skip=skipped.append)
    assert loaded["step"] == 2 and torch.equal(weights(fresh), saved[2])
    assert skipped == [f"step-00000003: ds/{model_file.name} does not match its SHA-256 in meta.json"]
    assert "skipping checkpoint step-00000003" in caplog.text
    # With two ranks, each checks the files of its own number: the corrupt one is rank 0's to find.
    assert checkpoint_files.verify(tmp_path / "step-00000003", rank=1, world=2) is None
    assert "does not match" in checkpoint_files.verify(tmp_path / "step-00000003", rank=0, world=2)

    # A checkpoint without its meta.json is partial: the one before it is loaded.
    (tmp_path / "step-00000002" / "meta.json").unlink()
    loaded = checkpoint_files.load_latest(engine_factory(seed=2), tmp_path, on_skip=skipped.append)
    assert loaded["step"] == 1 and "step-00000002: no readable meta.json" in skipped

    # Keep the newest K and the newest healthy ones.
    assert checkpoint_files.prune(tmp_path, keep=1, keep_healthy=1) == ["step-00000002"]
    assert [p.name for p in checkpoint_files.published(tmp_path)] == ["step-00000003", "step-00000001"]
    assert checkpoint_files.load_latest(engine_factory(seed=3), tmp_path / "nothing") is None


def test_resume_continues_rng_and_optimizer_exactly(engine_factory, tmp_path):
    a = engine_factory()
    a.train()
    train_step(a, 1)
    checkpoint_files.save(a, tmp_path, 1, {})
    train_step(a, 2)
    after = weights(a)
    b = engine_factory(seed=9)  # another init, another RNG state: both come back from the checkpoint
    b.train()
    torch.rand(3)
    checkpoint_files.load_latest(b, tmp_path)
    train_step(b, 2)  # dropout masks and Adam moments as in a's second step
    assert torch.equal(weights(b), after)


def test_a_background_save_holds_the_state_at_the_call_and_a_failed_write_leaves_the_previous(
        engine_factory, tmp_path, monkeypatch):
    """Training goes on while a background save is written: what is written is the state when save() was
    called (copied to host memory then), and it resumes exactly. A write that fails half-way (as on a crash)
    publishes nothing: the previous checkpoint stays the newest, and wait() says why."""
    a = engine_factory()
    a.train()
    train_step(a, 1)
    checkpoint_files.save(a, tmp_path, 1, {}).wait()
    train_step(a, 2)
    at_save = weights(a)
    gate, real_save = threading.Event(), torch.save

    def held_save(obj, path, *args, **kwargs):
        assert gate.wait(60)
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    write = checkpoint_files.save(a, tmp_path, 2, {"loader": {"step": 2}}, background=True)
    train_step(a, 3)  # the thread has written nothing yet: the tensors it holds are copies
    after_3 = weights(a)
    assert [p.name for p in checkpoint_files.published(tmp_path)] == ["step-00000001"]
    gate.set()
    assert write.wait().name == "step-00000002" and write.seconds > 0
    b = engine_factory(seed=9)
    b.train()
    assert checkpoint_files.load_latest(b, tmp_path)["loader"] == {"step": 2}
    assert torch.equal(weights(b), at_save)
    train_step(b, 3)  # Adam's moments and the RNG as they were at the call
    assert torch.equal(weights(b), after_3)

    written = []

    def failing_save(obj, path, *args, **kwargs):
        if written:
            raise OSError("No space left on device")
        written.append(path)
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    write = checkpoint_files.save(a, tmp_path, 3, {}, background=True)
    with pytest.raises(RuntimeError, match="checkpoint step-00000003 was not written: OSError"):
        write.wait()
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in checkpoint_files.published(tmp_path)] == ["step-00000002", "step-00000001"]
    assert (tmp_path / ".tmp-step-00000003").is_dir() and written
    assert checkpoint_files.load_latest(engine_factory(seed=5), tmp_path)["step"] == 2


def test_schedule_is_opt_s():
    s = Schedule(peak=6e-4, warmup_steps=100, total_steps=1100, final_ratio=0.1)
    assert s.lr(1) == pytest.approx(6e-6) and s.lr(100) == pytest.approx(6e-4)
    assert s.lr(600) == pytest.approx(6e-4 * (1 - 0.9 * 0.5))
    assert s.lr(1100) == pytest.approx(6e-5) and s.lr(5000) == pytest.approx(6e-5)
    s.factor = 0.5
    assert s.lr(100) == pytest.approx(3e-4)


def test_no_weight_decay_on_biases_and_layer_norms():
    model = OPT(get("tiny"))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or "layer_norm" in names[id(p)] for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"decoder.embed_tokens.weight", "decoder.layers.0.fc1.weight"}
    opt = adamw(model, 1e-3, 0.1)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_deepspeed_config_per_precision():
    common = dict(micro_batch=2, accumulation=4, world_size=8, grad_clip=1.0)
    fp16 = deepspeed_config(zero_stage=3, precision="fp16", **common)
    assert fp16["train_batch_size"] == 64 and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert fp16["zero_optimization"] == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert deepspeed_config(zero_stage=2, precision="bf16", **common)["bf16"] == {"enabled": True}
    # bf16 at ZeRO-0: an fp32 engine, the forward under torch's autocast (the loop's); a pipeline keeps DeepSpeed's
    assert "bf16" not in deepspeed_config(zero_stage=0, precision="bf16", **common)
    assert autocast_dtype(zero_stage=0, precision="bf16") is torch.bfloat16
    assert autocast_dtype(zero_stage=1, precision="bf16") is autocast_dtype(zero_stage=0, precision="fp32") is None
    fp32 = deepspeed_config(zero_stage=2, precision="fp32", **common)
    assert "fp16" not in fp32 and "bf16" not in fp32 and fp32["gradient_clipping"] == 1.0
    json.dumps(fp32)


def test_a_gpus_rng_state_goes_into_the_checkpoint_and_back(monkeypatch):
    """On a GPU dropout draws from the device's generator: it is saved and restored with the others. No GPU
    here, so torch.cuda's getter and setter stand in (the GPU check, benchmarks/gpu_check.py, resumes a
    killed run on a real one and compares its losses step for step)."""
    device_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": device_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    state = checkpoint_files.rng_state()
    assert torch.equal(state["cuda"], device_state)
    checkpoint_files.set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], device_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuda" not in checkpoint_files.rng_state()


class _RunsCode:
    """What a planted file holds: unpickling it would run `exec` and write a marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_checkpoint_loads_no_pickle_and_takes_no_linked_folder(engine_factory, tmp_path, caplog):
    """The RNG file holds tensors and numbers, read back with `weights_only=True`: python's and numpy's states
    come back exactly. A planted RNG file whose unpickling runs code (its sha256 list rewritten to match, as
    whoever can write the folder can) is refused without running, and a `step-*` symbolic link to a folder
    elsewhere is not a checkpoint at all."""
    import random
    import shutil

    import numpy as np

    root = tmp_path / "ckpt"
    a = engine_factory()
    train_step(a, 1)
    random.seed(5)
    np.random.seed(6)
    checkpoint_files.save(a, root, 1, {})
    expected = (random.random(), float(np.random.rand()))
    random.seed(0)
    np.random.seed(0)
    checkpoint_files.load_latest(a, root)
    assert (random.random(), float(np.random.rand())) == expected

    step = root / "step-00000001"
    marker, rng = tmp_path / "marker", step / "rng-rank00000.pt"
    torch.save(_RunsCode(marker), rng)
    meta = json.loads((step / "meta.json").read_text())
    meta["files"][rng.name][:2] = [checkpoint_files._sha256(rng), rng.stat().st_size]
    (step / "meta.json").write_text(json.dumps(meta))
    elsewhere = tmp_path / "elsewhere" / "step-99999999"
    shutil.copytree(step, elsewhere)
    (root / "step-99999999").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger=checkpoint_files.log.name):
        assert checkpoint_files.published(root) == [step]
        assert checkpoint_files.load_latest(a, root)["step"] == 1
    assert not marker.exists()
    assert "step-99999999 is a symbolic link" in caplog.text and "rng-rank00000.pt holds more than tensors" in caplog.text
    # DeepSpeed's own files are read the same way (its engine would unpickle them whole): the load stops, naming it.
    (model_file,) = step.rglob("*model_states.pt")
    torch.save(_RunsCode(marker), model_file)
    meta["files"][str(model_file.relative_to(step))][:2] = [checkpoint_files._sha256(model_file), model_file.stat().st_size]
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match=r"model_states.pt holds more than tensors and DeepSpeed's known types"):
        checkpoint_files.load_latest(a, root)
    assert not marker.exists()


def test_a_link_anywhere_inside_a_checkpoint_is_refused(tmp_path):
    """Only `step-*` itself was checked: a real `step-*/` whose `ds/` links to a folder elsewhere, with a meta.json
    that matches that folder's files, verified."""
    import os
    import shutil

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model_states.pt").write_bytes(b"planted")
    step = tmp_path / "ckpt" / checkpoint_files.step_name(100)
    step.mkdir(parents=True)
    (step / "ds").symlink_to(elsewhere)
    planted = step / "ds" / "model_states.pt"
    files = {"ds/model_states.pt": [checkpoint_files._sha256(planted), planted.stat().st_size, 0]}
    (step / "meta.json").write_text(json.dumps({"step": 100, "files": files}))
    assert checkpoint_files.published(step.parent) == [step]
    assert checkpoint_files.verify(step) == f"step-00000100: ds is a symbolic link (to {elsewhere}): refused"
    os.unlink(step / "ds")
    shutil.copytree(elsewhere, step / "ds")
    assert checkpoint_files.verify(step) is None  # the same files, in the folder itself


RESHAPE_STAGES = (0, 1, 2, 3)  # ZeRO stages: 0 loads at any degree as it is; 1-3 through DeepSpeed's universal format


def _dp_engine(rank: int, world: int, zero: int):
    """The tiny model without dropout under ZeRO-`zero` on `world` data-parallel ranks: a global batch of 4
    sequences in micro-batches of 2, so that gradient accumulation makes up the ranks that are not there."""
    import deepspeed

    from train.build import build

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds = deepspeed_config(micro_batch=2, accumulation=2 // world, world_size=world, zero_stage=zero, precision="fp32",
                          grad_clip=1.0)
    model = build(get("tiny").replace(dropout=0.0), ds, seed=0, rank=rank)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model, 1e-3, 0.1), config=ds)
    return engine


def _global_step(engine, step: int, rank: int, world: int) -> float:
    """Global batch `step` (the same 4 sequences whatever the degree), this rank's rows of it; the mean loss."""
    import torch.distributed as dist

    mine = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
    total = torch.zeros(())
    for micro in mine.split(2):
        loss = engine(micro[:, :-1], micro[:, 1:])
        engine.backward(loss)
        engine.step()
        total += loss.detach() / len(mine.split(2))
    dist.all_reduce(total)
    return total.item() / world


def _full_weights(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=hasattr(
            next(engine.module.parameters()), "ds_tensor")):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _dp_phase(rank: int, world: int, root: str, first: int, last: int, save_at: int | None) -> dict:
    """For each ZeRO stage: steps first..last on `world` ranks, from the checkpoint of step first - 1 in root/zero<k>
    when first > 1, saving one at step `save_at`; {stage: (losses, weights after `last`)}."""
    from pathlib import Path

    out = {}
    for zero in RESHAPE_STAGES:
        engine, folder = _dp_engine(rank, world, zero), Path(root) / f"zero{zero}"
        if first > 1:
            checkpoint_files.load(engine, folder / checkpoint_files.step_name(first - 1))
        losses = {}
        for step in range(first, last + 1):
            losses[step] = _global_step(engine, step, rank, world)
            if step == save_at:
                checkpoint_files.save(engine, folder, step, {"health": {"healthy": True}})
        out[zero] = (losses, _full_weights(engine))
        engine.destroy()
    return out


def _dp_there_and_back(rank: int, world: int, root: str) -> tuple[dict, dict]:
    """On 2 ranks: the run that never changes (steps 1-6, saving at step 2); then, once this test's own process has
    gone on from step 2 to step 4 alone (it writes `alone-done`), steps 5-6 from its checkpoint of step 4. One set of
    processes for both: each costs seconds to start."""
    import time
    from pathlib import Path

    unchanged = _dp_phase(rank, world, root, 1, 6, 2)
    (Path(root) / f"first-done-{rank}").touch()
    deadline = time.monotonic() + 300
    while not (Path(root) / "alone-done").exists():
        assert time.monotonic() < deadline, "the one-rank phase did not finish"
        time.sleep(0.05)
    return unchanged, _dp_phase(rank, world, root, 5, 6, None)


def test_a_checkpoint_loads_into_another_data_parallel_degree_under_every_zero_stage(deepspeed_rank, tmp_path, caplog):
    """Data-parallel 2 -> 1 -> 2 under ZeRO 0-3: written by 2 ranks at step 2, continued by 1 (its gradient
    accumulation making up the other) to step 4, then by 2 again to step 6. Every step's loss, and the weights at
    the end, are the never-changed run's: ZeRO 1-3 through DeepSpeed's ds_to_universal and universal loading
    (train/checkpoint_files.py `universal`), ZeRO-0 as it is. Without the conversion DeepSpeed refuses the load;
    without the ZeRO-3 mends (each group's weight decay, a step count per state) the weights drift by ~1e-3."""
    from test_parallel import run_ranks

    import time

    alone = {}

    def go_on_alone():  # this process, rank 0 of 1: steps 3-4 from the 2 ranks' checkpoint of step 2
        while not all((tmp_path / f"first-done-{rank}").exists() for rank in (0, 1)):
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="train.checkpoint_files"):
            alone.update(_dp_phase(0, 1, str(tmp_path), 3, 4, 4))
        (tmp_path / "alone-done").touch()

    [(reference, again), _] = run_ranks(2, _dp_there_and_back, str(tmp_path), meanwhile=go_on_alone)
    for zero in RESHAPE_STAGES:
        model_states = next((tmp_path / f"zero{zero}" / "step-00000002" / "ds").glob("*model_states.pt"))
        info = checkpoint_files.safe_load(model_states)["universal_checkpoint_info"]
        assert info["universal_checkpoint_version"] == 0.4  # and how each parameter splits over tensor ranks:
        assert r"decoder\.layers\.1\.fc2\.weight$" in info[checkpoint_files.ROW_PATTERNS]  # by input
        assert r"decoder\.layers\.1\.fc2\.bias$" in info[checkpoint_files.REPLICATED_PATTERNS]  # whole on each
        assert not any("q_proj" in p for p in info[checkpoint_files.ROW_PATTERNS] + info[checkpoint_files.REPLICATED_PATTERNS])
        meta = checkpoint_files.read_meta(tmp_path / f"zero{zero}" / "step-00000002")
        assert meta["layout"] == {"data_parallel": 2, "zero_stage": zero, "tensor": 1, "pipeline": 1}
    converted = [r.getMessage() for r in caplog.records if "universal format" in r.getMessage()]
    assert len(converted) == 3 and all("written by 2 data-parallel ranks, loaded by 1" in m for m in converted), converted
    for zero in RESHAPE_STAGES:
        assert not list((tmp_path / f"zero{zero}").glob(".universal-*"))  # removed once loaded
        losses = {**alone[zero][0], **again[zero][0]}
        assert losses == pytest.approx({s: reference[zero][0][s] for s in losses}, rel=1e-5), zero
        for name, w in reference[zero][1].items():
            assert torch.allclose(torch.as_tensor(again[zero][1][name]), torch.as_tensor(w), atol=1e-6), (zero, name)


def test_a_checkpoint_that_cannot_load_into_this_layout_is_refused_saying_why(tmp_path):
    """What `load` does with a checkpoint's recorded layout: as it is when unchanged (or unrecorded, from before), or
    at another data-parallel degree under ZeRO-0; converted at another data-parallel, tensor or pipeline degree under
    ZeRO 1-3; refused, naming why, between ZeRO-0 and ZeRO 1-3, between ZeRO 1-2 and ZeRO-3, for a tensor change
    under ZeRO-0, and for a split one recorded before its degrees were."""
    def layout(dp, zero, tensor=1, pipeline=1):
        return {"data_parallel": dp, "zero_stage": zero, "tensor": tensor, "pipeline": pipeline}

    path, two = tmp_path / "step-00000010", layout(2, 2)
    reshaped = checkpoint_files.reshaped
    assert not reshaped(path, {"world_size": 2, "layout": two}, two, 2)
    assert not reshaped(path, {"world_size": 2}, layout(1, 2), 1)
    assert not reshaped(path, {"world_size": 2, "layout": {"data_parallel": 2, "zero_stage": 2}}, two, 2)  # recorded
    assert reshaped(path, {"world_size": 2, "layout": two}, layout(1, 2), 1)  # before tensor and pipeline were
    assert reshaped(path, {"world_size": 2, "layout": layout(1, 1, tensor=2)}, layout(2, 1), 2)
    assert not reshaped(path, {"world_size": 2, "layout": layout(2, 0)}, layout(1, 0), 1)
    with pytest.raises(RuntimeError, match="under ZeRO-0 and this run is under ZeRO-2: .* neither loads into the other"):
        reshaped(path, {"world_size": 2, "layout": layout(2, 0)}, two, 2)
    with pytest.raises(RuntimeError, match="under ZeRO-2 and this run is under ZeRO-3: DeepSpeed 0.19's ZeRO-3"):
        reshaped(path, {"world_size": 2, "layout": two}, layout(4, 3), 4)
    with pytest.raises(RuntimeError, match="tensor degree 2 and this run's is 1: under ZeRO-0 no optimizer partitions"):
        reshaped(path, {"world_size": 2, "layout": layout(1, 0, tensor=2)}, layout(2, 0), 2)
    (path / "ds").mkdir(parents=True)  # a pipeline's first model states, as written before they described every stage
    torch.save({"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}, path / "ds" / "mp_rank_00_model_states.pt")
    with pytest.raises(RuntimeError, match="pipeline of 2 stages before its first stage described every stage's"):
        reshaped(path, {"world_size": 4, "layout": layout(2, 1, pipeline=2)}, layout(1, 1, pipeline=2), 2)
    torch.save({"universal_checkpoint_info": checkpoint_files.UNIVERSAL_VERSION | {
        checkpoint_files.PIPELINE_REPLICATED_PATTERNS: [re.escape(TIED)]}}, path / "ds" / "mp_rank_00_model_states.pt")
    assert reshaped(path, {"world_size": 4, "layout": layout(2, 1, pipeline=2)}, layout(1, 1, pipeline=2), 2)
    assert reshaped(path, {"world_size": 2, "layout": layout(1, 1, pipeline=2)}, layout(2, 2), 2)  # out of a pipeline
    with pytest.raises(RuntimeError, match="2 replicas of a model split over 2 workers, before its tensor and pipeline"):
        reshaped(path, {"world_size": 4, "layout": {"data_parallel": 2, "zero_stage": 2}}, layout(1, 2, tensor=2), 2)


def test_deepspeeds_own_loads_in_a_conversion_read_no_pickle(tmp_path):
    """DeepSpeed's ds_to_universal and universal loading call `torch.load(weights_only=False)` themselves; while
    they run (`_weights_only_loads`), every such load reads weights only and refuses, naming the file, what needs
    pickle's code. Outside it, torch.load is torch's again."""
    torch.save({"w": torch.ones(2)}, tmp_path / "fine.pt")
    torch.save({"w": _RunsCode(tmp_path / "ran")}, tmp_path / "planted.pt")
    with checkpoint_files._weights_only_loads():
        assert torch.equal(torch.load(tmp_path / "fine.pt", map_location="cpu", weights_only=False)["w"], torch.ones(2))
        with pytest.raises(RuntimeError, match=r"planted\.pt holds more than tensors .* refused, since loading it could run code"):
            torch.load(tmp_path / "planted.pt", map_location=torch.device("cpu"), weights_only=False)
    assert not (tmp_path / "ran").exists()
    assert torch.load.__module__ == "torch.serialization" and torch.load.__name__ == "load"


def merge_named(item: tuple[str, int]) -> str:  # a merge phase's work, as ds_to_universal's `merge_tp_slices` is named
    if item[0] == "fails":
        raise ValueError("no such parameter")
    return f"{item[0]}@{os.environ['RANK']}"


def _spread_on(rank: int, world: int) -> dict:
    from functools import partial

    from train.checkpoint_files import _Handed, _spread

    out = {"extracted": _spread(lambda item: (item, rank), [(2, 0), (0, 1), (1, 0), (0, 0)], 1)}
    for key, names in (("merged", ["b", "c", "a"]), ("failed", ["b", "fails"])):
        try:
            out[key] = _spread(partial(merge_named), [(n, 0) for n in names], 1)
        except _Handed:
            out[key] = "handed"
        except RuntimeError as exc:
            out[key] = str(exc)
    return out


def test_a_conversions_work_is_shared_out_over_the_ranks_and_its_errors_raised_on_every_rank():
    """DeepSpeed's ds_to_universal runs on every rank at once (train/checkpoint_files.py `_convert`), its work lists
    shared by `_spread`: each rank does every world-th item of the same sorted list (DeepSpeed builds the merge's from
    a set, in another order in each process), every rank gets every result, and after the merge the ranks but 0
    leave for rank 0 to write the rest. One rank's error is raised on all, where a wait would hang."""
    from test_parallel import run_ranks

    zero, one = run_ranks(2, _spread_on)
    assert zero["extracted"] == one["extracted"] == [((0, 0), 0), ((1, 0), 0), ((0, 1), 1), ((2, 0), 1)]
    assert zero["merged"] == ["a@0", "c@0", "b@1"] and one["merged"] == "handed"
    assert zero["failed"] == one["failed"] == "rank 1: ValueError('no such parameter')"
