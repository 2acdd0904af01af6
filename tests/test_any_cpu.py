"""The suite on any CPU: DeepSpeed refuses fp16 engines where oneDNN has no fp16 kernels (most laptops, AVX2-only
AMD servers), and one fp16 measurement refused once took every 3D-parallel test down with it. Such a CPU is
simulated on any host by core/cpu.py's AVX2_ONLY (`make test CPU=avx2` runs the whole suite so); these tests
keep the suite's ways of building fp16 engines working under it, and every benchmark naming its CPU."""

from __future__ import annotations

import ast
import os
import platform
import re
import subprocess
import sys

import pytest

from conftest import CPU_FEATURE, ROOT
from core.cpu import AVX2_ONLY, this_cpu


# The simulation holds an x86-64 CPU to AVX2; an ARM CPU (a Mac laptop) has no such instruction set to hold to.
x86_only = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason=f"{CPU_FEATURE}: the AVX2-only simulation needs an x86-64 CPU, not {platform.machine()}")


def _fp16_engine_on_an_avx2_only_cpu(rank, world):
    """In a spawned rank started under AVX2_ONLY: what oneDNN and DeepSpeed's own check say there, DeepSpeed's
    refusal with the check as DeepSpeed ships it, and an fp16 ZeRO-1 engine's steps once `_rank_main` lifted it."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from model.configs import get
    from train.build import build
    from train.optim import adamw, deepspeed_config

    accelerator = get_accelerator()
    said = {"onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "aten": torch.backends.cpu.get_cpu_capability(),
            "deepspeed_shipped": bool(type(accelerator).is_fp16_supported(accelerator)),
            "deepspeed_here": bool(accelerator.is_fp16_supported())}
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = get("tiny").replace(n_layer=1)
    config = deepspeed_config(micro_batch=2, accumulation=1, world_size=world, zero_stage=1, precision="fp16",
                              grad_clip=1.0)

    def engine():
        model = build(cfg, config, seed=0, rank=rank)
        return deepspeed.initialize(model=model, optimizer=adamw(model, 1e-3, 0.1), config=config)[0]

    lifted = accelerator.is_fp16_supported
    del accelerator.is_fp16_supported  # DeepSpeed's own check, as a test without the lift would meet it
    try:
        engine()
        said["refused"] = None
    except ValueError as e:
        said["refused"] = str(e)
    accelerator.is_fp16_supported = lifted
    e = engine()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        e.backward(e(x, x))
        e.step()
    said["dtype"] = str(next(e.module.parameters()).dtype)
    said["loss_scale"] = float(e.optimizer.loss_scale)
    return said


@x86_only
def test_fp16_engines_build_in_a_spawned_rank_on_an_avx2_only_cpu(monkeypatch):
    """The simulation takes hold in a spawned rank (oneDNN without fp16 or bf16, ATen's AVX2 kernels), DeepSpeed
    as shipped refuses fp16 there as on the AVX2-only EPYC host, and the suite's lift (tests/test_parallel.py's
    `_rank_main`, as conftest's `deepspeed_rank` in this process and gpu_check's Ray workers) makes it train."""
    from test_parallel import run_ranks

    for key, value in AVX2_ONLY.items():
        monkeypatch.setenv(key, value)  # a spawned process starts with this process's environment
    [said] = run_ranks(1, _fp16_engine_on_an_avx2_only_cpu, fresh=True)  # torch imported under the limits
    assert (said["onednn_fp16"], said["onednn_bf16"], said["aten"]) == (False, False, "AVX2"), said
    assert not said["deepspeed_shipped"] and said["deepspeed_here"], said
    assert said["refused"] and "fp16 is not supported" in said["refused"], said
    assert said["dtype"] == "torch.float16" and said["loss_scale"] > 0, said


def test_make_test_cpu_avx2_is_the_simulation():
    """`make test CPU=avx2` exports exactly AVX2_ONLY: the whole-suite run and this file simulate one CPU."""
    makefile = (ROOT / "Makefile").read_text()
    exported = dict(re.findall(r"^\s*export (\w+)\s*=\s*(\S+)", makefile, re.M))
    assert exported == AVX2_ONLY


def test_the_cpu_is_described_with_the_features_that_change_our_speed():
    cpu = this_cpu()
    line = cpu.describe()
    assert line.startswith(cpu.model) and f"{cpu.cores} cores" in line
    for name in ("AVX2", "AVX-512", "AVX-512-BF16", "AVX-512-FP16", "AMX-BF16", "AMX-FP16"):
        assert re.search(rf"\b{name} (yes|no|unknown)\b", line), (name, line)
    if sys.platform == "linux":
        assert all(v is not None for v in cpu.features.values())


def test_every_benchmark_prints_its_cpu_first():
    """Each benchmark's main() prints provenance.header() (commit, CPU model and features, torch's and numpy's
    kernels and threads) before anything else: first, or right after its arguments are parsed. A benchmark is a
    file of benchmarks/ that runs as a script (`if __name__ == "__main__"`); a file without that is a library the
    scripts share (chaos_cluster.py), and has no main of its own."""
    late = []
    for script in sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "provenance.py"):
        tree = ast.parse(script.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if not any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body):
            assert not mains, f"{script.name} has a main() but does not run as a script"
            continue
        main = mains[0]
        body = [s for s in main.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        parsed = [i for i, s in enumerate(body) if "parse_args(" in ast.unparse(s)]
        first = body[parsed[0] + 1 if parsed else 0]
        if ast.unparse(first) != "print(provenance.header(), flush=True)":
            late.append(f"{script.name}: {ast.unparse(first)[:80]}")
    assert not late, late


@x86_only
def test_provenance_prints_the_cpu_and_any_isa_limit():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "provenance.py")], capture_output=True, text=True,
                         env={**os.environ, **AVX2_ONLY}, check=True).stdout.splitlines()
    assert out[0].startswith("commit ") and out[1].startswith(f"CPU: {this_cpu().model}")
    assert "ISA limited by ONEDNN_MAX_CPU_ISA=AVX2" in out[1]
    assert re.match(r"torch \S+: AVX2 kernels, oneDNN fp16 no, bf16 no, \d+ threads; numpy ", out[2]), out[2]


def test_a_skip_for_a_cpu_feature_is_counted_on_the_console(pytester):
    """conftest's summary counts the skips whose reason names a CPU feature (conftest.CPU_FEATURE), and only those."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(f"""
        import pytest
        def test_lacking():
            pytest.skip("{CPU_FEATURE}: torch's fp16 kernels fail on this CPU")
        def test_other():
            pytest.skip("for another reason")
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["1 skipped for a feature this CPU lacks (*): *test_lacking"])
