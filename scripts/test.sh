#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything in
# build/ and runs the whole suite with ctest (labels: gradcheck, reference,
# errors, checkpoint; `ctest --test-dir build -L <label>` runs one area), then
# the sanitizer run (scripts/sanitize.sh: ASan + UBSan unit tests and the fuzz
# targets, in build-san/). Arguments go to ctest and select a part of the
# suite; the sanitizer run is skipped then.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
jobs=$(nproc 2>/dev/null || echo 2)
"$HALYARD_CMAKE" --build "$root/build" -j "$jobs"
cd "$root/build"
ctest --output-on-failure -j "$jobs" "$@"
if (($#)); then
  echo "[test] ctest arguments given: skipping scripts/sanitize.sh (run it on its own)"
else
  bash "$root/scripts/sanitize.sh"
fi
