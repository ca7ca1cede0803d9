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

  # The node-side steps past the tests, which no run here reaches without a
  # device: an nvidia-smi that names a GPU whose driver the programs cannot
  # load. Every benchmark must write its line (skipped, with the plan's
  # predictions), the fit must say it had nothing to fit, and the summary
  # must be whole; llama_train's failure to find the device fails the run.
  mkdir -p "$work/fake"
  printf '#!/bin/sh\necho "NVIDIA H100 80GB HBM3 (a stand-in), 81559 MiB, 0.0"\n' >"$work/fake/nvidia-smi"
  chmod +x "$work/fake/nvidia-smi"
  rc=0
  PATH="$work/fake:$PATH" bash "$work/node/gpu_check.sh" run "$work/node" "$work/fake_results" >"$work/fake_out.txt" 2>&1 || rc=$?
  ((rc == 1)) || { cat "$work/fake_out.txt"; echo "FAIL: run with a driver that does not load exited $rc, not 1"; exit 1; }
  skipped=$(grep -c '"peer":"halyard".*"skip":"no CUDA driver.*"predicted_step_s"' "$work/fake_results/bench.jsonl" || true)
  ((skipped == 8)) || { cat "$work/fake_out.txt"; echo "FAIL: $skipped of 8 benchmark lines say they skipped"; exit 1; }
  grep -q 'no kernel profile to fit' "$work/fake_results/fit.txt" || { echo "FAIL: the fit did not say it had nothing"; exit 1; }
  for table in '## The target: Llama-3.2-1B' '## The time model fitted to this GPU'; do
    grep -q "$table" "$work/fake_results/summary.md" || { cat "$work/fake_out.txt"; echo "FAIL: the summary lacks '$table'"; exit 1; }
  done
fi
echo "gpu_check test: passed"
