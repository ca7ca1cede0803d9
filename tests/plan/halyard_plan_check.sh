#!/usr/bin/env bash
# halyard-plan as a user runs it: the tiny Llama's longest sequence on 4 CPU
# ranks with every output file, checked for content; bad arguments are errors
# that name the problem; llama_aot's SCHEDULE autosp names what would fit when
# nothing does.
#   halyard_plan_check.sh <halyard-plan> <llama_aot> <source dir>
set -euo pipefail
plan=$1 aot=$2 src=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$plan" --model tiny --cluster local-cpu --ranks 4 --memory-per-rank 128MiB --seq max --zero 1 \
  --families default,dp_zero3,ulysses,ulysses_checkpoint,ulysses_sac,autosp \
  --json "$dir/r.json" --trace "$dir/t.json" --plot "$dir/p.png" --schedule-out "$dir/s.json" >"$dir/out.txt"
grep -q "autosp chose, at seq" "$dir/out.txt" || fail "no choice printed"
grep -q "longest trainable sequence" "$dir/out.txt" || fail "no family table"
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
r = json.load(open(f"{d}/r.json"))
fams = {f["family"]: f for f in r["families"]}
assert set(fams) == {"default", "dp_zero3", "ulysses", "ulysses_checkpoint", "ulysses_sac", "autosp"}, fams.keys()
best = fams["autosp"]["longest_seq"]
for name, f in fams.items():
    assert f["applies"], (name, f["reason"])
    assert f["peak_bytes_per_rank"] <= r["memory_per_rank_bytes"], name
    assert f["longest_seq"] <= best, (name, f["longest_seq"], best)  # the search reaches at least every family
assert r["autosp"]["plan"]["predicted_peak_bytes_per_rank"] <= r["memory_per_rank_bytes"]
t = json.load(open(f"{d}/t.json"))
tracks = {e["tid"] for e in t["traceEvents"] if e["ph"] == "X"}
assert tracks == {1, 2}, tracks  # compute and communication
# Each track runs one thing at a time; some collective runs beside a kernel
# (a Ulysses all-to-all under the projections after it); the step ends with
# the update, at the plan's step time.
spans = {tid: sorted((e["ts"], e["ts"] + e["dur"]) for e in t["traceEvents"] if e["ph"] == "X" and e["tid"] == tid)
         for tid in (1, 2)}
for tid, s in spans.items():
    for (a0, a1), (b0, b1) in zip(s, s[1:]):
        assert b0 >= a1 - 1e-3, (tid, a0, a1, b0)
beside = sum(1 for c0, c1 in spans[2] if c1 > c0 and any(k0 < c1 - 1e-3 and c0 < k1 - 1e-3 for k0, k1 in spans[1]))
assert beside > 0, "no collective runs beside a kernel"
step_us = r["autosp"]["plan"]["predicted_step_s"] * 1e6
assert abs(max(b for _, b in spans[1]) - step_us) < 1e-6 * step_us + 1, (max(b for _, b in spans[1]), step_us)
s = json.load(open(f"{d}/s.json"))
assert s["mesh"]["sp"] * s["mesh"]["dp"] == 4 and s["mesh"]["zero"] in (0, 1), s["mesh"]
png = open(f"{d}/p.png", "rb").read()
assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
PY

# The pinned schedule plans again, through llama_aot.
"$aot" --name pinned --config "$src/examples/llama/configs/tiny.json" --seq 4096 --schedule "$dir/s.json" \
  --cluster local-cpu --plan-only >"$dir/pinned.txt" || fail "the written schedule does not plan"

# SCHEDULE autosp with bf16 allowed, for GPUs: the search computes the
# contractions in bf16 (tensor cores), and the pinned schedule says so.
"$aot" --name mixed --config "$src/examples/llama/configs/tiny.json" --seq 32768 --schedule autosp --cluster 8xH200 \
  --ranks 8 --sp 8 --bf16 store,contract --target host-cuda-cuda_capability_80 --plan-only \
  --schedule-out "$dir/mixed.json" >"$dir/mixed.txt" || { cat "$dir/mixed.txt"; fail "autosp with --bf16"; }
grep -q '"contract_precision": "bf16"' "$dir/mixed.json" || fail "autosp on 8xH200 with bf16 allowed kept f32 contractions"

# A loss tiled for a GPU's 32-bit indexing alone keeps its tiles where they
# fit (Llama-3.2-1B at 32k on one H200), and the choice's line says so.
"$plan" --model llama-3.2-1b --cluster 8xH200 --ranks 1 --seq 32768 --bf16 store,contract --families none \
  >"$dir/1b.txt" || { cat "$dir/1b.txt"; fail "Llama-3.2-1B on one H200"; }
grep -A1 "autosp chose" "$dir/1b.txt" | grep -q "; tiles kept" || { head -5 "$dir/1b.txt"; fail "the 1B plan's loss tiles are not kept"; }

expect_error() {  # expect_error <text> <command...>
  local want=$1
  shift
  if "$@" >"$dir/err.txt" 2>&1; then fail "succeeded: $*"; fi
  grep -q -- "$want" "$dir/err.txt" || { cat "$dir/err.txt"; fail "no \"$want\" in the error of: $*"; }
}
expect_error 'no model preset "llama-9"' "$plan" --model llama-9
expect_error '"1e9" is not a whole number' "$plan" --model tiny --ranks 1e9
expect_error '"-4" is not a whole number' "$plan" --model tiny --seq -4
expect_error "is not a size" "$plan" --model tiny --memory-per-rank 80XB
expect_error 'no family "zero9"' "$plan" --model tiny --families zero9
expect_error 'give one of --model NAME and --config FILE' "$plan"
expect_error 'bf16 choice "stor"' "$plan" --model tiny --cluster local-cpu --memory-per-rank 128MiB --bf16 stor
expect_error 'autosp strategy "tree"' "$plan" --model tiny --cluster local-cpu --memory-per-rank 128MiB --seq 4096 --strategies ulysses,tree
expect_error 'states no bf16 peak above its f32 one' "$plan" --model tiny --cluster local-cpu --memory-per-rank 128MiB \
  --seq 4096 --bf16 contract
expect_error 'bf16 choice "fp8"' "$aot" --name x --config "$src/examples/llama/configs/tiny.json" --seq 1024 \
  --schedule autosp --bf16 store,fp8 --plan-only
expect_error 'autosp strategy "tree"' "$aot" --name x --config "$src/examples/llama/configs/tiny.json" --seq 1024 \
  --schedule autosp --ranks 4 --memory-per-rank 268435456 --strategies ring,tree --plan-only
expect_error 'are what --schedule autosp searches with' "$aot" --name x --config "$src/examples/llama/configs/tiny.json" \
  --seq 1024 --schedule ulysses --sp 4 --strategies ring --plan-only
expect_error 'the least memory any plan needs is' "$aot" --name x --config "$src/examples/llama/configs/tiny.json" \
  --seq 65536 --schedule autosp --ranks 2 --memory-per-rank 268435456 --cluster local-cpu --plan-only
grep -q "ranks would fit" "$dir/err.txt" || fail "the infeasible build does not name the ranks that would fit"
# Two rows of 3M tokens: [batch, seq, ffn] steps its batch axis 2.3G
# elements, past a Halide buffer's 32-bit strides; refused before compiling.
expect_error "a Halide buffer's strides and extents hold at most" "$aot" --name big \
  --config "$src/examples/llama/configs/tiny.json" --batch 2 --seq 3000000 --out "$dir"
grep -q 'fix: train one row per rank' "$dir/err.txt" || fail "the stride error names no fix"
# Halide's GPU kernels index in 32 bits: Llama-3.2-1B's logits at 32,768
# tokens (4.2G elements) are refused for CUDA, with the fix, before compiling.
expect_error "Halide's GPU kernels index in 32 bits" "$aot" --name big1b \
  --config "$src/examples/llama/configs/llama-3.2-1b.json" --seq 32768 --target host-cuda-cuda_capability_80 --plan-only
grep -q 'fix: tile the loss and the MLP over the sequence' "$dir/err.txt" || fail "the GPU indexing error names no fix"
# cuBLAS contractions are for CUDA targets only.
echo '{"contract_kernel": "cublas"}' >"$dir/cublas.json"
expect_error 'legal: "auto" or "halide" here' "$aot" --name x \
  --config "$src/examples/llama/configs/tiny.json" --seq 1024 --schedule "$dir/cublas.json" --plan-only
# Offloading is for GPU targets: on a CPU the memory is host memory already.
echo '{"values": [{"match": "*", "keep": "offload"}]}' >"$dir/offload.json"
expect_error 'is a CPU: its memory is host memory already' "$aot" --name x \
  --config "$src/examples/llama/configs/tiny.json" --seq 1024 --schedule "$dir/offload.json" --plan-only
"$plan" --help | grep -q "usage: halyard-plan" || fail "--help"
echo "halyard-plan: ok"
