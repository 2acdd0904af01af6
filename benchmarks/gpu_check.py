"""The GPU check: what a session with a lent GPU runs first, in one command (a few minutes on one H100).

    .venv/bin/python benchmarks/gpu_check.py [--out /tmp/gpu_check]   # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --dry-run                # on CPU: the same checks, tiny

Each check runs the real train stage (`train.stage.run`: Ray Train, DeepSpeed, our loop, checkpoints,
MLflow; check 2 its Ray Train job alone) with one worker on the GPU, over token shards it generates
(a learnable sequence rule, so the loss must fall):

1. bf16, ZeRO-3 (the model built partitioned, OPT's init per partition), 125M: the loss falls, and
   the export (gathered piece by piece, sharded, labelled bfloat16) loads in transformers with our loss.
2. fp16, ZeRO-2, an injected burst of overflowing steps on DeepSpeed's real dynamic loss scaler: the
   scale halves as DeepSpeed's rules say, the autopilot rolls back and resets it, the skipped steps'
   grad norms are recorded as overflows and the spike score stays finite.
3. Run 1's worker is killed midway and resumed from its last checkpoint: the steps between that
   checkpoint and the kill, run twice, have the same losses the second time (the GPU's RNG was
   restored, so dropout drew the same masks; bf16 kernels are not bitwise deterministic, hence a
   tolerance on a GPU, reported).
4. MFU: benchmarks/bench_train.py for 125M and 1.3B in bf16 (tokens/s, TFLOP/s, MFU, against a bare
   PyTorch loop).

`--dry-run` runs the same four on CPU at tiny scale (fp16 allowed on the CPU for check 2, as the
tests do), so that the script keeps working before a GPU comes (tests/test_gpu_path.py runs it).
It prints a verdict table and writes verdicts.json; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402
from core.ray_session import init_ray  # noqa: E402
from train import records  # noqa: E402
from bench_tokenize import FORMAT, INDEX, write_rows  # noqa: E402
from bench_train import train_stage  # noqa: E402

# Per device: the model, sequence length, micro-batch and global batch (sequences), steps, checkpoint interval,
# the step run 1's worker is killed at, vocabulary, check 3's tolerance (relative, on each step run twice),
# and bench_train's steps per model.
SETUPS = {
    "cuda": {"model": "125m", "seq_len": 2048, "micro": 8, "batch": 32, "steps": 30, "every": 10, "kill_at": 15,
             "vocab": 50272, "resume_rtol": 3e-3, "bench_steps": None},
    "cpu": {"model": "tiny", "seq_len": 64, "micro": 8, "batch": 16, "steps": 12, "every": 5, "kill_at": 8,
            "vocab": 512, "resume_rtol": 1e-6, "bench_steps": 4},
}


@dataclass
class Verdict:
    check: str
    ok: bool
    detail: str
    seconds: float


def learnable_shards(folder: Path, sequences: int, seq_len: int, vocab: int) -> None:
    """Token shards in the tokenize stage's layout whose next token follows from the one before (an
    arithmetic progression from a random start): a model that trains at all brings the loss down fast."""
    rng = np.random.default_rng(0)
    span = min(vocab - 4, 997)
    starts = rng.integers(0, span, (sequences, 1))
    rows = (4 + (starts + 7 * np.arange(seq_len + 1)) % span).astype(np.uint16)
    write_rows(folder / "train" / "00000.arrow", rows)
    (folder / INDEX).write_text(json.dumps({
        "format": FORMAT, "seq_len": seq_len, "block": seq_len + 1, "dtype": "uint16", "vocab_size": vocab, "eos_id": 2,
        "sequences": sequences, "train": {"sequences": sequences, "shards": [{"file": "train/00000.arrow", "sequences": sequences}]},
        "eval": {"units": []}}))


def steps_of(output: Path) -> list[dict]:
    return records.read(output, records.STEP)


def base_overrides(s: dict, device: str) -> list[str]:
    return [f"train.model={s['model']}", "train.num_workers=1", f"train.gpus_per_worker={1 if device == 'cuda' else 0}",
            f"train.cpus_per_worker={2 if device == 'cpu' else 8}", f"train.micro_batch_size={s['micro']}",
            f"train.global_batch_tokens={s['batch'] * s['seq_len']}", f"train.max_steps={s['steps']}",
            f"train.total_tokens={s['steps'] * s['batch'] * s['seq_len']}", "train.warmup_tokens=0", "train.eval_every=0", "train.seeds=1",
            f"train.checkpoint_every={s['every']}", "train.lr=3e-3"]


BF16 = "1. bf16, ZeRO-3, export to transformers"


def as_verdict(check: str, run, *args) -> Verdict:
    """`run(*args)`, its exception a failed verdict rather than a crash: the other checks' results still print."""
    t0 = time.perf_counter()
    try:
        return run(*args)
    except Exception as exc:
        return Verdict(check, False, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)


def check_bf16(out: Path, shards: Path, s: dict, device: str) -> tuple[Verdict, Path]:
    import torch
    from transformers import OPTForCausalLM

    from model.hf import from_pretrained
    from train.loader import TokenShards

    t0 = time.perf_counter()
    output = train_stage(out, "bf16", shards, [*base_overrides(s, device), "train.precision=bf16", "train.zero_stage=3",
                                               f"train.inject=[{{kind: kill, step: {s['kill_at']}}}]"])  # for check 3
    losses = list({r["step"]: r["loss"] for r in steps_of(output)}.values())  # the resumed value of a step run twice
    export = output / "model"
    dtype = json.loads((export / "config.json").read_text())["torch_dtype"]
    # seq_len tokens, not the block's seq_len + 1: transformers' OPT embeds a position for every input
    # token, labels included, and has no position past max_position_embeddings (= seq_len on the GPU).
    tokens = torch.from_numpy(TokenShards(shards).rows(np.arange(4)).astype(np.int64))[:, :s["seq_len"]]
    ours = from_pretrained(export).eval()
    theirs = OPTForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        our_loss = ours(tokens[:, :-1], tokens[:, 1:]).item()
        their_loss = theirs(input_ids=tokens, labels=tokens).loss.item()
    problems = []
    if not losses[-1] < 0.9 * losses[0]:
        problems.append(f"the loss did not fall by a tenth: {losses[0]:.3f} -> {losses[-1]:.3f}")
    if dtype != "bfloat16":
        problems.append(f"the export says {dtype}, its weights are bf16")
    if not math.isclose(our_loss, their_loss, rel_tol=1e-4):
        problems.append(f"transformers' loss {their_loss:.5f} != ours {our_loss:.5f}")
    if not our_loss < 0.95 * losses[0]:
        problems.append(f"the exported weights are not the trained ones (loss {our_loss:.3f})")
    detail = (f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps; export {dtype}, "
              f"{len(list(export.glob('*.safetensors')))} file(s), transformers' loss {their_loss:.4f} = ours {our_loss:.4f}")
    return Verdict(BF16, not problems, "; ".join(problems) or detail,
                   time.perf_counter() - t0), output


def check_fp16_overflow(out: Path, shards: Path, s: dict, device: str) -> Verdict:
    """Ray Train and the training loop (`train.stage.fit`), without the stage's MLflow and output copies
    (check 1 has them): on a CPU (the dry run) the loop first lets DeepSpeed take fp16, which
    config validation refuses there."""
    from pipelines.config import load_config
    from pipelines.config import CHECKS
    from train.spikes import read_grad_norms, spike_score
    from train.loop.config import loop_config
    from train.stage import fit

    def fp16_on_cpu_loop(config) -> None:  # a closure: shipped to the workers by value
        from train.cpu_fp16 import allow_deepspeed_fp16
        from train.loop import train_loop

        allow_deepspeed_fp16()
        train_loop(config)

    t0 = time.perf_counter()
    at, count = 4, 10  # the autopilot's overflow_limit: the 10th overflow within 50 steps is a collapse
    section = load_config(ROOT / "configs" / "local.yaml", [
        f"workdir={out}/work", *base_overrides(s, device), f"train.max_steps={at + count + 4}", "train.zero_stage=2",
        f"train.precision={'bf16' if device == 'cpu' else 'fp16'}", "train.checkpoint_every=3",
        "train.autopilot.rollback_steps=1", f"train.inject=[{{kind: overflow, step: {at}, count: {count}}}]"],
        checks=CHECKS).train
    section = dataclasses.replace(section, precision="fp16")
    output = out / "fp16"
    output.mkdir(parents=True)
    fit(section, loop_config(section, str(shards), output, export_dir=None),
        out / "fp16-ray", loop=fp16_on_cpu_loop if device == "cpu" else None)
    rows = steps_of(output)
    burst = [r for r in rows if r["overflow"]]
    book = records.read(output, records.ENTRY)
    incidents = [r["what"] for r in records.read(output, records.INCIDENT)]
    score = spike_score(read_grad_norms(output))
    scales = [r["loss_scale"] for r in burst]
    problems = []
    # DeepSpeed's scaler (hysteresis 2): the first overflow spends the hysteresis, each further one halves the scale.
    if scales != [2.0 ** 16] + [2.0 ** (16 - k) for k in range(1, len(scales))] or len(burst) < 10:
        problems.append(f"loss scales over the overflowing steps {scales}")
    if any(r["grad_norm"] is not None for r in burst):
        problems.append("an overflow-skipped step's grad norm was recorded as a measurement")
    if [(e["kind"], e["actions"]) for e in book] != [("loss_scale_collapse", ["rollback", "skip", "reset_loss_scale"])]:
        problems.append(f"autopilot: {[(e['kind'], e['actions']) for e in book]}")
    if not any(w.startswith("loss scale reset: ") for w in incidents):
        problems.append("no loss-scale reset in incidents.jsonl")
    after = [r for r in rows if r["step"] > burst[-1]["step"]] if burst else []
    if not after or any(r["overflow"] for r in after):
        problems.append("training did not go on cleanly after the rollback")
    if not math.isfinite(score.score):
        problems.append(f"the spike score is {score.score}")
    detail = (f"{len(burst)} overflows, scale {scales[0]:g} -> {scales[-1]:g}, then {book[0]['kind'] if book else '?'}: "
              f"{', '.join(book[0]['actions']) if book else '?'} back to step {book[0]['rolled_back_to'] if book else '?'}; "
              f"spike score {score.score:.2f}")
    return Verdict("2. fp16 overflow burst on DeepSpeed's scaler", not problems, "; ".join(problems) or detail,
                   time.perf_counter() - t0)


def check_kill_resume(output: Path, s: dict, seconds: float) -> Verdict:
    """Run 1 again: its worker was killed at `kill_at` and resumed from the newest checkpoint published by
    then, so the steps in between were logged twice, before the kill and after the resume.

    Which checkpoint that is depends on the device's speed: a background save still being written when the
    worker dies is lost, as it should be (on an H100 a 125M ZeRO-3 save outlasts five steps). So the check
    reads the resume point from incidents.jsonl, requires a checkpoint step before the kill, and says when a
    save in flight was lost."""
    kill, every = s["kill_at"], s["every"]
    first, again = {}, {}
    for r in steps_of(output):
        (again if r["step"] in first else first)[r["step"]] = r["loss"]
    incidents = [r["what"] for r in records.read(output, records.INCIDENT)]
    resumed = [int(w.rsplit("-", 1)[1]) for w in incidents if w.startswith("resumed from step-")]
    problems = []
    if len(resumed) != 1 or resumed[0] % every or not resumed[0] < kill or \
            not any(w.startswith("injected kill") for w in incidents):
        problems.append(f"incidents: {incidents}")
    resume = resumed[0] if resumed else -1
    worst = math.inf
    if sorted(again) != list(range(resume + 1, kill)):
        problems.append(f"steps run twice: {sorted(again)}, expected {resume + 1}..{kill - 1}")
    elif again:
        worst = max(abs(again[k] - first[k]) / abs(first[k]) for k in again)
        if worst > s["resume_rtol"]:
            problems.append(f"after the resume, steps {sorted(again)} differ from their first run by up to {worst:.1e}")
    lost = kill // every * every
    detail = (f"killed at step {kill}, resumed from step {resume}"
              f"{f' (the save of step {lost} was still being written: lost)' if resume < lost else ''}: "
              f"steps {resume + 1}-{kill - 1} again within {worst:.1e} of their first run")
    return Verdict("3. kill and resume (RNG restored)", not problems, "; ".join(problems) or detail, seconds)


def check_mfu(out: Path, s: dict, device: str) -> Verdict:
    from bench_train import measure

    t0 = time.perf_counter()
    models, precision = (["125m", "1.3b"], "bf16") if device == "cuda" else (["tiny"], "fp32")
    try:
        table = [line for line in measure(models, device, precision, out / "bench_train", s["bench_steps"])
                 if line.startswith("| ") and not line.startswith("| model")]
        ok, detail = len(table) == len(models), " / ".join(line.strip("| ") for line in table)
    except Exception as exc:  # a verdict, not a crash: the other checks' results still print
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Verdict(f"4. bench_train {precision}: {', '.join(models)}", ok, detail, time.perf_counter() - t0)


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on CPU, at tiny scale: the script's own plumbing")
    p.add_argument("--out", default="/tmp/gpu_check")
    p.add_argument("--checks", default="1,2,3,4", type=lambda v: {int(c) for c in v.split(",")},
                   help="which checks to run, e.g. 1,2,3 where gap_attrib.py measures check 4's step in the same "
                        "device call (check 3 reads what check 1 left, so it needs 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    if 3 in args.checks and 1 not in args.checks:
        raise SystemExit("--checks: check 3 resumes check 1's run, so it needs check 1")
    import ray
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without one", file=sys.stderr)
        return 2
    s = SETUPS[device]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    shards = out / "shards"
    learnable_shards(shards, s["batch"] * (s["steps"] + 12), s["seq_len"], s["vocab"])
    init_ray(os.cpu_count())
    try:
        verdicts = []
        if 1 in args.checks:
            try:
                bf16, run = check_bf16(out, shards, s, device)
            except Exception as exc:  # run 1 itself failed: its verdict, and check 3 reads what it left
                bf16, run = Verdict(BF16, False, f"{type(exc).__name__}: {exc}", 0.0), out / "bf16" / "stage" / "output"
            verdicts.append(bf16)
        if 2 in args.checks:
            verdicts.append(as_verdict("2. fp16 overflow burst on DeepSpeed's scaler", check_fp16_overflow, out, shards, s,
                                       device))
        if 3 in args.checks:
            verdicts.append(as_verdict("3. kill and resume (RNG restored)", check_kill_resume, run, s, bf16.seconds))
        if 4 in args.checks:
            verdicts.append(check_mfu(out, s, device))
    finally:
        ray.shutdown()

    name = torch.cuda.get_device_name(0) if device == "cuda" else "the CPU above"
    print(f"{name}{'; dry run' if args.dry_run else ''}")
    print()
    print("| check | verdict | seconds | what was seen |")
    print("|---|---|---|---|")
    for v in verdicts:
        print(f"| {v.check} | {'pass' if v.ok else 'FAIL'} | {v.seconds:.0f} | {v.detail} |")
    (out / "verdicts.json").write_text(json.dumps([asdict(v) for v in verdicts], indent=1))
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
