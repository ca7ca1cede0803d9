#!/usr/bin/env bash
# ctest's fuzz_run_<target>: runs a libFuzzer binary from the committed corpus
# for a bounded time. New inputs go to a fresh temporary directory (libFuzzer
# writes to the first corpus directory it is given), never into the repo; a
# crashing input is kept under $HALYARD_FUZZ_ARTIFACTS (default: the current
# directory, ctest's build directory) and its path is printed.
#   run_fuzzer.sh <fuzzer> <corpus dir> [libFuzzer flags...]
set -euo pipefail
fuzzer=$1 corpus=$2
shift 2
new=$(mktemp -d "${TMPDIR:-/tmp}/halyard_fuzz_XXXXXX")
trap 'rm -rf "$new"' EXIT
artifacts=${HALYARD_FUZZ_ARTIFACTS:-$PWD}/fuzz-artifacts/$(basename "$fuzzer")/
mkdir -p "$artifacts"
status=0
"$fuzzer" -artifact_prefix="$artifacts" "$@" "$new" "$corpus" || status=$?
if [ "$status" -ne 0 ]; then
  echo "error: $(basename "$fuzzer") failed (exit $status); the input is under $artifacts." >&2
  echo "fix the bug, then add the input to $corpus so that fuzz_replay_* keeps it fixed." >&2
fi
exit "$status"
