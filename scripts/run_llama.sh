#!/usr/bin/env bash
# The README's main command: installs what is missing, builds the tiny Llama
# and runs forward+backward of its joint graph on the bundled corpus with the
# reference interpreter, printing the graph, the loss, gradient norms and a
# few SGD steps. Extra arguments go to the binary (see --help in its source).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama_reference
"$root/build/examples/llama/llama_reference" --steps 5 "$@"
