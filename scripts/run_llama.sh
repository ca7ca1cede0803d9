#!/usr/bin/env bash
# The README's main command: installs what is missing; lets the AutoSP search
# choose the tiny Llama's schedule (examples/llama/configs/tiny.json, global
# seq 8192) for 4 CPU ranks with 120 MiB each: the mesh, the head
# redistribution, the tiles and what to recompute (printed at build time,
# and by the trainer before step 1); AOT-compiles it with Halide; and trains
# it with sequence parallelism on 4 MPI ranks of this machine on the King
# James Bible (4.1 MB of public-domain text from Debian's bible-kjv, 5% held
# out for validation), printing one progress line per step and the
# validation loss every 10 steps. It ends by turning the run's metrics into
# build/main_job/metrics.png (loss and validation loss, tokens/s, per-rank
# memory against step). Extra arguments go to the trainer (--steps N --lr X
# --save DIR ...; llama_train_main --help lists them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama_train_main halyard-plot-metrics
out=$root/build/main_job
mkdir -p "$out"
# The corpus: every verse of the KJV, one per line, without its reference.
corpus=$out/kjv.txt
if [ ! -s "$corpus" ]; then
  bible -f "gen1:1-rev22:21" | sed 's/^[^ ]* //' >"$corpus.tmp"
  mv "$corpus.tmp" "$corpus"
fi
rm -f "$out/metrics.jsonl"  # a fresh run's curve, not appended to the last one's
# Root needs OpenMPI's consent; 4 ranks on 2 cores need --oversubscribe;
# unbound, because Open MPI pins one or two ranks to a core each, which would
# halve a single rank's Halide threads.
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 \
  "$root/build/examples/llama/llama_train_main" --steps 50 --data "$corpus" --val-every 10 \
  --metrics "$out/metrics.jsonl" "$@"
"$root/build/examples/llama/halyard-plot-metrics" "$out/metrics.jsonl" "$out/metrics.png"
