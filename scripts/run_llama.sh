#!/usr/bin/env bash
# The README's main command: installs what is missing, AOT-compiles the tiny
# Llama (examples/llama/configs/tiny.json, seq 512, schedule "recompute") into
# a static library with Halide, and trains it on the bundled corpus with AdamW,
# printing one progress line per step. Extra arguments go to llama_train
# (--steps N --lr X --threads T --data FILE).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama_train
"$root/build/examples/llama/llama_train" --steps 200 "$@"
