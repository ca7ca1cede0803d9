#!/usr/bin/env bash
# ctest gpu_check: scripts/gpu_check.sh prepare into a scratch folder, which
# must stay under 60 MiB, then run from that folder alone (copied elsewhere,
# so nothing reaches back into the source or build tree). Here, without a
# GPU, every device part must say why it skipped and the results folder must
# hold the logs, the tests' XML and the summary; with a GPU, run must pass.
set -euo pipefail
src=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

bash "$src/scripts/gpu_check.sh" prepare "$work/prepared" --build-dir "$build" --no-build
bytes=$(du -sb "$work/prepared" | cut -f1)
echo "prepared folder: $bytes bytes"
((bytes < 60 * 1024 * 1024)) || { echo "FAIL: the prepared folder is $bytes bytes, over 60 MiB"; exit 1; }

mv "$work/prepared" "$work/node"  # the node sees only the folder, under another path
rc=0
bash "$work/node/gpu_check.sh" run "$work/node" "$work/results" >"$work/out.txt" 2>&1 || rc=$?
cat "$work/out.txt"
((rc == 0)) || { echo "FAIL: run exited $rc"; exit 1; }
for f in run.log device.txt summary.md test_cuda.xml test_nccl_single_rank.xml test_cuda.log; do
  [[ -s $work/results/$f ]] || { echo "FAIL: results/$f missing or empty"; exit 1; }
done
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  grep -q '^\[SKIP\] bench: no CUDA device' "$work/out.txt" || { echo "FAIL: the bench did not say why it skipped"; exit 1; }
  grep -q '^\[SKIP\] llama_train: no CUDA device' "$work/out.txt" || { echo "FAIL: llama_train did not say why it skipped"; exit 1; }
  grep -q 'NoDeviceIsAClearError' "$work/results/test_cuda.log" || { echo "FAIL: a CUDA step's no-device error was not checked"; exit 1; }
  grep -q "\[SKIP\] no CUDA" "$work/results/test_cuda.log" || { echo "FAIL: test_cuda did not say why it skipped"; exit 1; }
  grep -q 'NoDeviceThrowsAClearError' "$work/results/test_nccl_single_rank.log" || { echo "FAIL: NCCL's no-device error was not checked"; exit 1; }
fi
echo "gpu_check test: passed"
