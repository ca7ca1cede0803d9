#!/usr/bin/env bash
# The README's main command: installs what is missing, AOT-compiles the tiny
# Llama (examples/llama/configs/tiny.json, global seq 1024) into one library
# per sp degree with Halide (schedule examples/llama/schedules/
# ulysses_recompute.json: sequence split over the ranks, Ulysses all-to-alls
# around attention), and trains it with sequence parallelism on 4 MPI ranks
# of this machine on the bundled corpus, printing one progress line per step.
# HALYARD_RANKS=1|2|4 picks another rank count; extra arguments go to
# llama_train (--steps N --lr X --zero 1 --save DIR --metrics FILE ...).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama_train
# Root needs OpenMPI's consent; 4 ranks on 2 cores need --oversubscribe;
# unbound, because Open MPI pins one or two ranks to a core each, which would
# halve a single rank's Halide threads.
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np "${HALYARD_RANKS:-4}" \
  "$root/build/examples/llama/llama_train" --steps 200 "$@"
