# The two commands of the README: `make run` (the embedded pipeline) and `make test`.
# Both create .venv with the project installed when it is missing or pyproject.toml changed.
# On a machine without an NVIDIA GPU torch comes in as torch==2.13.0, the CPU build; with
# one, the normal (CUDA) torch. Pass pipeline options with ARGS="--only dedup --force".

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
# WORKERS=2: the suite on 2 pytest-xdist workers, each module's tests on one worker and in order, every module that
# reads the README run's pipeline on the same one (tests/conftest.py): faster on an idle machine, but a
# timing-sensitive test can fail under the contention (docs/testing.md). 0 (the default): one process.
WORKERS ?= 0

# `make test CPU=avx2`: the suite as on an AVX2-only CPU (most laptops, many AMD servers), on any x86-64 host:
# oneDNN, ATen and MKL held to AVX2 in every process, so oneDNN has no fp16 or bf16 kernels and DeepSpeed refuses
# fp16 as it does there (core/cpu.py AVX2_ONLY, which tests/test_any_cpu.py holds these to).
ifeq ($(CPU),avx2)
export ONEDNN_MAX_CPU_ISA = AVX2
export ATEN_CPU_CAPABILITY = avx2
export MKL_ENABLE_INSTRUCTIONS = AVX2
endif

.PHONY: run test install clean

run: $(STAMP)
	$(PY) pipelines/full.py $(ARGS)

# pytest exits 5 when it collects no test (e.g. a -k that matches nothing); make would report
# any failure as 2, so the exit code is read here, where it can still be seen.
test: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --no-loadscope-reorder $(PYTEST_ARGS) || { rc=$$?; [ $$rc -eq 5 ] && echo "pytest: no tests collected" && exit 0; exit $$rc; }

install: $(STAMP)

# --no-compile, then compileall on every core: pip byte-compiles one file at a time (50 s of the install on
# 2 cores, 21 s this way). Compiling at install matters: where PYTHONDONTWRITEBYTECODE is set (as on our CI
# machines) nothing is cached later, and every Ray worker would compile torch and Ray again (the suite took
# 13.9 instead of 9.2 min). torch ships one file in Python 3.12 syntax, which pip skips as well.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet --no-compile torch; \
	else \
		$(PY) -m pip install --quiet --no-compile torch==2.13.0; \
	fi
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	$(PY) -m compileall -qq -j 0 -x 'torch/testing/_internal/py312_intrinsics' $(VENV)/lib
	touch $(STAMP)

clean:
	rm -rf $(VENV) work data .pytest_cache
