#!/usr/bin/env bash
# GPU check of `proxy.engine: sglang`: one CUDA GPU, at most ~8 minutes, nothing downloaded
# (the ~0.5B random-init Qwen3 is built locally). Steps and output: benchmarks/gpu_check.py.
#
# Install once on the GPU machine (the only step that needs the network):
#   python3 -m venv .venv && . .venv/bin/activate
#   pip install torch --index-url https://download.pytorch.org/whl/cu128   # a CUDA torch<2.14
#   pip install -e '.[dev,sglang]'                 # rollart, its tests, aiohttp (SGLang client)
#   pip install uv && uv pip install sglang        # SGLang, per docs.sglang.io/get_started/install.html
# When SGLang's torch clashes with rollart's (torch<2.14), give SGLang its own environment:
#   python3 -m venv /opt/sglang && /opt/sglang/bin/pip install uv \
#     && /opt/sglang/bin/uv pip install --python /opt/sglang/bin/python sglang
#   export ROLLART_SGLANG_PYTHON=/opt/sglang/bin/python   # the engine launches the server with it
#
# Run:
#   bash benchmarks/gpu_check.sh                   # full check; one JSON summary on stdout
#   bash benchmarks/gpu_check.sh --quick           # a ~100M model, lighter load (~3 min)
#   bash benchmarks/gpu_check.sh --out benchmarks/results/gpu_check.json
#   bash benchmarks/gpu_check.sh --self-test       # only the CPU-side parts (any machine)
# Progress goes to stderr. Exit status: 0 every check passed, 1 one failed, 2 this machine
# cannot run it (no GPU, no sglang, no aiohttp; the summary says which).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [ "${1:-}" != "--self-test" ] && [ "${1:-}" != "--help" ] && [ "${1:-}" != "-h" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists none);" \
         "run it on a CUDA machine" >&2
    printf '{"check": "sglang-gpu", "ok": false, "unfit": "no NVIDIA GPU (nvidia-smi)"}\n'
    exit 2
  fi
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# gpu_check.py keeps to --budget-s (480 s); this is the hard stop if something hangs (the
# SGLang server it launched is stopped with it)
exec timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-600}" "$PY" benchmarks/gpu_check.py "$@"
