#!/usr/bin/env bash
# ctest gpu_check_summary: the summary gpu_check.sh run ends with, from a
# bench.jsonl of every kind of line the GPU node writes (summary_bench.jsonl:
# made-up figures, chosen so that each ratio is exact; a timeout, an
# out-of-memory error, a crash, a device that could not be used). The
# summary runs only on a GPU node; a slip in it would cost that node's run
# its tables, so it is checked here.
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/node/configs" "$work/results"
cp "$src/examples/llama/configs/tiny.json" "$src/examples/llama/configs/llama-3.2-1b.json" "$work/node/configs/"
cp "$src/tests/gpu/summary_bench.jsonl" "$work/results/bench.jsonl"
echo "NVIDIA H100 80GB HBM3 (made up)" >"$work/results/device.txt"
printf 'halyard-fit-kernels: base 8xH100-80GB\n  contract  30 calls: (made up)\n' >"$work/results/fit.txt"
bash "$src/scripts/gpu_check.sh" summarize "$work/results" "$work/node" >"$work/out.txt"
cat "$work/out.txt"
cmp -s "$work/out.txt" "$work/results/summary.md" || { echo "FAIL: summary.md is not what summarize printed"; exit 1; }

fail=0
expect() {  # a line that must be in the summary, as a fixed string
  grep -qF -- "$1" "$work/out.txt" || { echo "FAIL: missing: $1"; fail=1; }
}
# The tiny Llama: tokens/s and their ratios, peaks, copies; an error cell.
expect '| 8192 | 10000 | 1000000 | 0.01x | 20000 | 400000 | 0.05x | 700 / 1000 | 300 | 1 |'
expect '| 16384 | error: exit 124 (timeout or crash; see bench.err) | - | - | error: out of device memory | - | - |'
# A device the program could not use (a driver that does not load) is a result too.
expect '| 32768 | skipped: no CUDA driver (libcuda.so.1 not found) | - | - | - | - | - |'
# Attention per layer (2 layers): 10 ms and 5 ms against 1 ms and 8 ms.
expect '| 8192 | 5.00 | 1.00 | 0.20x | 10.00 | 8.00 | 0.80x |'
# The target: AutoSP's plan against PyTorch, the hand-written run crashed.
expect '| tokens/s | 10000 | error: exit 137 (timeout or crash; see bench.err) | 40000 | 0.250x | - |'
expect '| peak device MiB | 40000 | error: exit 137 (timeout or crash; see bench.err) | 50000 | 0.800x | - |'
expect '| attention fwd+bwd, one layer, ms | 30.00 | error: exit 137 (timeout or crash; see bench.err) | 15.00 | 0.500x | - |'
# Each plan's predictions against the measurement (the moments left out of
# the peak); a library that failed has no row.
expect '| llama-3.2-1b autosp 32768 | 8xH100-80GB | 1.6384 | 3.2768 | 2.00x | 40000 | 40000 | 1.00x |'
expect '| tiny bf16_mixed 8192 | 8xH100-80GB | 0.0151 | 0.8192 | 54.25x | 1390 | 700 | 0.50x |'
expect '| tiny default 8192 | 8xH100-80GB | 0.0160 | 0.4096 | 25.60x | 1340 | 1000 | 0.75x |'
# The time model fitted to the GPU (halyard-fit-kernels' output).
expect '## The time model fitted to this GPU (halyard-fit-kernels; gpu_profile.json)'
expect '  contract  30 calls: (made up)'
if grep -q 'default 16384' "$work/out.txt"; then echo "FAIL: a failed run has a row of predictions"; fail=1; fi
# Every table's rows have as many cells as its header.
python3 - "$work/out.txt" <<'PY' || fail=1
import sys
header = None
for n, line in enumerate(open(sys.argv[1]), 1):
    if not line.startswith("|"):
        header = None
        continue
    cells = line.rstrip("\n").count("|")
    if header is None:
        header = cells
    elif cells != header:
        sys.exit(f"FAIL: line {n} has {cells - 1} cells, its table's header {header - 1}: {line.strip()}")
PY
((fail == 0)) && echo "gpu_check_summary: passed"
exit $fail
