#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and configures the CMake build in
# build/ with the venv's CMake and Ninja. Shared by the README's two commands.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
# shellcheck disable=SC1091
source "$root/.venv/halyard.env"
"$HALYARD_CMAKE" -S "$root" -B "$root/build" -G Ninja -DHalide_DIR="$HALYARD_HALIDE_DIR" >"$root/build.configure.log" 2>&1 \
  || { cat "$root/build.configure.log"; exit 1; }
