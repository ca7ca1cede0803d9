#!/usr/bin/env bash
# The README's main command: installs what is missing; lets the AutoSP search
# choose the tiny Llama's schedule (examples/llama/configs/tiny.json, global
# seq 4096) for 4 CPU ranks with 88 MiB each: the mesh, the head
# redistribution, the tiles and what to recompute (printed at build time,
# and by the trainer before step 1); AOT-compiles it with Halide; and trains
# it with sequence parallelism on 4 MPI ranks of this machine on the bundled
# corpus (repeated to fill a row), printing one progress line per step. Extra arguments go to the
# trainer (--steps N --lr X --save DIR --metrics FILE ...).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama_train_main
# Root needs OpenMPI's consent; 4 ranks on 2 cores need --oversubscribe;
# unbound, because Open MPI pins one or two ranks to a core each, which would
# halve a single rank's Halide threads.
# A row of 4,096 tokens needs more text than the bundled corpus holds: it is
# repeated (a later --data or --tokens replaces it).
corpus=$root/build/main_corpus.txt
for _ in 1 2 3 4; do cat "$root/examples/llama/data/corpus.txt"; done >"$corpus"
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 \
  "$root/build/examples/llama/llama_train_main" --steps 40 --data "$corpus" "$@"
