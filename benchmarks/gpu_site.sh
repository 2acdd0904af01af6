#!/usr/bin/env bash
# Packs this project's Python dependencies into one archive for a GPU machine that has Python 3.12,
# torch and CUDA but no package index (the lent machine that runs benchmarks/gpu_check.py).
#
#   bash benchmarks/gpu_site.sh HAVE [OUT]   # HAVE: the names the machine's image already has, one per line
#   # there:  mkdir -p /tmp/site && tar xJf OUT -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
#
# The versions are the ones in this machine's .venv (`make install`), so the GPU runs the code the suite
# tested. Wheels are unpacked, not installed, and what the checks never load goes (Ray's Java jars and
# RLlib, MLflow's web UI): Ray's wheel alone is 79 MB, and a device call carries 64 MiB. DeepSpeed ships
# no wheel; its own is built here with no ops (they compile on the GPU machine when first used).
set -euo pipefail
have=$1
out=${2:-.whl/site312.tar.xz}
py=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

platforms=()
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
norm() { tr 'A-Z_' 'a-z-'; }
skip=$(norm <"$have"; printf '%s\n' torch opt-pipeline deepspeed ruff py-spy virtualenv distlib python-discovery)
wanted=$($py -m pip freeze --exclude-editable | grep '==' | while IFS= read -r req; do
  name=$(printf '%s' "${req%%==*}" | norm)
  grep -qxF "$name" <<<"$skip" || case $name in nvidia-*|triton) ;; *) echo "$req" ;; esac
done)

$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$work/wheels" $wanted
DS_BUILD_OPS=0 $py -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" \
  "$($py -m pip freeze | grep -i '^deepspeed==')"

mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -o -q "$wheel" -d "$work/site"; done
rm -rf "$work"/site/ray/jars "$work"/site/ray/rllib "$work"/site/mlflow/server/js
mkdir -p "$(dirname "$out")"
tar cf - -C "$work/site" . | xz -T0 -6 >"$out"
ls -l "$out"
