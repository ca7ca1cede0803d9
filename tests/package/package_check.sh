#!/usr/bin/env bash
# The installed package, as a user gets it (ctest: package):
#   package_check.sh <build dir> <cmake>
# installs the build tree into a prefix, MOVES the prefix (the tree must be
# relocatable), then configures, builds and runs tests/package/project (its
# own model, generator and training loop) against it with find_package(Halyard):
# the loss falls over 2 steps; and runs the installed halyard-plan and
# llama_train (its bundled corpus found next to it).
set -euo pipefail
build=$1 cmake=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$cmake" --install "$build" --prefix "$work/installed" >"$work/install.log" || { cat "$work/install.log"; fail "install"; }
mv "$work/installed" "$work/moved"  # relocatable: nothing may point back at the install path
prefix=$work/moved
for f in lib/cmake/Halyard/HalyardConfig.cmake lib/cmake/Halyard/halyard.cmake lib/libhalyard_runtime.a \
         include/halyard/dsl/ops.h include/halyard/runtime/model.h bin/halyard-plan bin/llama_train \
         share/halyard/data/corpus.txt; do
  [ -e "$prefix/$f" ] || fail "installed tree lacks $f"
done
if grep -rq "$work/installed" "$prefix/lib/cmake"; then fail "the CMake package names the install path"; fi

"$cmake" -S "$here/project" -B "$work/project" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; fail "configure against the installed tree"; }
"$cmake" --build "$work/project" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; fail "build"; }
out=$("$work/project/train" --steps 2) || fail "train: $out"
echo "$out"

"$prefix/bin/halyard-plan" --model tiny --cluster local-cpu --ranks 4 --memory-per-rank 88MiB --seq 4096 \
  --families none >"$work/plan.log" 2>&1 || { cat "$work/plan.log"; fail "installed halyard-plan"; }
grep -q "autosp chose" "$work/plan.log" || fail "halyard-plan: $(cat "$work/plan.log")"
out=$(cd "$work" && "$prefix/bin/llama_train" --steps 1 --threads 1 2>&1) || fail "installed llama_train: $out"
grep -q "step    1/1" <<<"$out" || fail "llama_train: $out"
echo "installed halyard-plan and llama_train run from $prefix"
echo PASS
