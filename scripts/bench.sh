#!/usr/bin/env bash
# Benchmarks: builds the bench programs and prints Halyard's figures next to
# its peers', measured in the same run (ratios are peer time / Halyard time,
# so > 1 means Halyard is faster). Prints figures; asserts nothing.
#
#   bash scripts/bench.sh            # THREADS=2 by default
#   ISA=avx2 bash scripts/bench.sh   # every side limited to AVX2 + FMA
#
# ISA=avx2 measures, on an AVX-512 machine, the code an AVX2-only x86 would
# run: the Halide kernels' target, Halyard's library kernels
# (HALYARD_CPU_ISA), Eigen's compile flags and PyTorch's kernels and MKL
# (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS) all stop at AVX2. It builds
# in build-avx2/. The microarchitecture is still this machine's.
#
# Peers: Eigen (matmul, same ISA flags as Halide's host target) and PyTorch
# eager (attention, training step). PyTorch is looked up in .venv-bench/ (make
# it with: python3 -m venv .venv-bench && .venv-bench/bin/pip install torch numpy)
# and then in Debian's python3-torch (apt-get install python3-torch
# libopenblas0-pthread); without torch, Halyard's own figures still print.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${THREADS:-2}
isa_limit=${ISA:-}
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
build="$root/build"
case "$isa_limit" in
  "") ;;
  avx2)
    build="$root/build-avx2"
    "$HALYARD_CMAKE" -S "$root" -B "$build" -G Ninja -DHalide_DIR="$HALYARD_HALIDE_DIR" -DHALYARD_BENCH_ISA=avx2 \
      >"$root/build-avx2.configure.log" 2>&1 || { cat "$root/build-avx2.configure.log"; exit 1; }
    export HALYARD_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    ;;
  *) echo "error: ISA=$isa_limit: legal values are avx2, or unset for this machine's own ISA" >&2; exit 2 ;;
esac
"$HALYARD_CMAKE" --build "$build" -j "$(nproc)" --target matmul_bench attention_bench step_bench ring_bench llama_aot >/dev/null
bin="$build/bench"
out=$(mktemp -d)

torch_py=""
for py in "$root/.venv-bench/bin/python" /usr/bin/python3; do
  if [ -x "$py" ] && "$py" -c "import torch" 2>/dev/null; then torch_py=$py; break; fi
done

# What the figures were measured on: a ratio means something only next to
# the machine and the peers' versions.
echo "== machine"
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
flags=$(lscpu | sed -n 's/^Flags: *//p')
isa=""
for f in sse4_1 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16; do
  grep -qw "$f" <<<"$flags" && isa+="$f "
done
echo "cpu: ${cpu:-unknown}; $(nproc) cores visible, $(lscpu | sed -n 's/^Thread(s) per core: *//p') thread(s) per core; bench threads: $threads"
echo "isa: ${isa:-none of the listed}"
echo "caches: L1d $(lscpu | sed -n 's/^L1d cache: *//p'), L2 $(lscpu | sed -n 's/^L2 cache: *//p'), L3 $(lscpu | sed -n 's/^L3 cache: *//p')"
echo "halide host target: $("$root/.venv/bin/python" -c 'import halide; print(halide.get_host_target())' 2>/dev/null || echo unknown)"
if [ -n "$isa_limit" ]; then
  echo "ISA limited to $isa_limit: $(cat "$build/bench/bench_isa.txt"), HALYARD_CPU_ISA=$HALYARD_CPU_ISA," \
    "ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS"
fi
eigen_h=/usr/include/eigen3/Eigen/src/Core/util/Macros.h
torch_ver="not found"
if [ -n "$torch_py" ]; then
  torch_ver=$("$torch_py" -c 'import re, torch; m = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show()); print(torch.__version__, "BLAS", m.group(1) if m else "?")' 2>/dev/null || echo "unknown")
fi
echo "peers: Eigen $(sed -n 's/^#define EIGEN_\(WORLD\|MAJOR\|MINOR\)_VERSION \([0-9]*\)/\2/p' "$eigen_h" 2>/dev/null | paste -sd.); PyTorch $torch_ver"
echo

echo "== matmul (generated kernels vs Eigen, $threads threads)"
"$bin/matmul_bench" --threads "$threads" | tee "$out/matmul.json"

for seq in 4096 16384; do
  echo; echo "== causal GQA attention forward+backward, seq $seq, heads 8, kv_heads 2, head_dim 32"
  # The schedule's default (library kernels, FlashAttention-2), then the
  # Halide-generated kernels it replaced, at 4096 (16384 takes them minutes).
  "$bin/attention_bench" --threads "$threads" --seq "$seq" --reps 3 2>/dev/null | tee -a "$out/attn_halyard.json"
  [ "$seq" = 4096 ] && "$bin/attention_bench" --threads "$threads" --seq "$seq" --reps 3 --kernel halide 2>/dev/null |
    tee -a "$out/attn_halyard_halide.json"
  [ -n "$torch_py" ] && "$torch_py" "$root/bench/torch_peer.py" attention --seq "$seq" --heads 8 --kv-heads 2 \
    --head-dim 32 --threads "$threads" --reps 3 | tee -a "$out/attn_torch.json"
done

echo; echo "== sequence-parallel strategies on 4 MPI ranks: attention time per rank, communication hidden"
mpirun --allow-run-as-root --oversubscribe -np 4 "$bin/ring_bench" --steps 5

echo; echo "== activation memory per rank (the generator's static plan, nothing run): 1 rank vs 4 (sp)"
aot="$build/examples/llama/llama_aot"
sched="$root/examples/llama/schedules"
printf '%-8s %16s %24s %16s %32s\n' seq "1: recompute" "1: checkpoint+tiled" "4: ulysses" "4: ulysses+checkpoint+tiled"
for seq in 16384 65536 131072; do
  row=$(printf '%-8s' "$seq")
  for cfg in "1 recompute" "1 $sched/checkpoint_tiled.json" "4 ulysses" "4 $sched/ulysses_checkpoint_tiled.json"; do
    set -- $cfg
    mib=$("$aot" --name plan --config "$root/examples/llama/configs/tiny.json" --schedule "$2" --seq "$seq" --sp "$1" \
      --plan-only | sed -n 's/.*arena \([0-9.]*\) MiB (train).*/\1/p' | head -1)
    w=16; case $2 in *tiled.json) w=24 ;; esac; [ "$1" = 4 ] && case $2 in *tiled.json) w=32 ;; esac
    row="$row $(printf "%${w}s" "$mib MiB")"
  done
  echo "$row"
done

# This machine's speed drifts by 20% and more from one minute to the next
# (shared hosts, boost clocks), more than the differences measured. So the
# peers run interleaved, in ROUNDS rounds of every schedule and PyTorch at
# each length, and each figure is its best round: both sides get the same
# chances at the machine's good minutes.
rounds=${ROUNDS:-3}
echo; echo "== tiny Llama training step (forward+backward), batch 1, $rounds interleaved rounds"
for seq in 1024 4096 8192; do
  # The step's useful work, from the plan: 3x the forward's FLOPs.
  "$aot" --name plan --config "$root/examples/llama/configs/tiny.json" --schedule default --seq "$seq" --sp 1 --plan-only |
    sed -n 's/.*(model FLOPs \([0-9.]*\):.*/{"seq":'"$seq"',"model_gflop":\1}/p' >> "$out/model_flops.json"
  for round in $(seq "$rounds"); do
    for sched in default recompute checkpoint tiled tiled_bf16; do
      "$bin/step_bench" --model "tiny_s${seq}_${sched}" --threads "$threads" --steps 3 | tee -a "$out/step_halyard.json"
    done
    [ -n "$torch_py" ] && "$torch_py" "$root/bench/torch_peer.py" step --config "$root/examples/llama/configs/tiny.json" \
      --seq "$seq" --batch 1 --threads "$threads" --steps 3 | tee -a "$out/step_torch.json"
  done
done
if [ -z "$torch_py" ]; then
  echo "(no PyTorch found: see the header of scripts/bench.sh to install the peer)"
  exit 0
fi

echo; echo "== ratios (PyTorch eager / Halyard, same run)"
python3 - "$out" <<'PY'
import json, sys, os
d = sys.argv[1]
def rows(name):
    p = os.path.join(d, name)
    return [json.loads(l) for l in open(p) if l.startswith("{")] if os.path.exists(p) else []
attn_peers = {r["seq"]: r for r in rows("attn_torch.json")}
for h in rows("attn_halyard.json") + rows("attn_halyard_halide.json"):
    t = attn_peers.get(h["seq"])
    if not t: continue
    tt = t.get("forward_backward_s") or t.get("s_median") or t.get("median_s")
    print(f"attention fwd+bwd seq {h['seq']} ({h.get('kernel', '?')} kernels): halyard {h['forward_backward_s']:.3f}s, pytorch {tt:.3f}s ({t.get('attention', '?')}, torch {t.get('torch')}), "
          f"speedup {tt / h['forward_backward_s']:.2f}x; peak RSS halyard {h['peak_rss_mib']:.0f} MiB, pytorch {t['peak_rss_mib']:.0f} MiB")
# Each side's best round (the most tokens/s) per length and schedule.
def best(rs, key):
    out = {}
    for r in rs:
        k = key(r)
        if k not in out or r["tokens_per_s"] > out[k]["tokens_per_s"]: out[k] = r
    return out
peers = best(rows("step_torch.json"), lambda r: r["seq"])
# Useful FLOP rate: the plan's model FLOPs per step (3x the forward's, no
# recompute) times steps per second, against Eigen's sgemm rate over the
# model's GEMM shapes measured above (seq 4096, same threads).
gflop = {r["seq"]: r["model_gflop"] for r in rows("model_flops.json")}
eig = [r for r in rows("matmul.json") if r.get("peer") == "eigen"]
eigen_rate = eig[0]["eigen_gflops"] if eig else None
def useful(seq, tok_s):
    if seq not in gflop or not eigen_rate: return ""
    r = gflop[seq] * tok_s / seq
    return f"{r:.0f} GFLOP/s = {100 * r / eigen_rate:.0f}% of Eigen's {eigen_rate:.0f}"
if eigen_rate:
    print(f"useful FLOPs per step (plan, 3x forward): " + ", ".join(f"seq {k}: {v:.1f} GFLOP" for k, v in sorted(gflop.items())))
for seq, t in sorted(peers.items()):
    u = useful(seq, t["tokens_per_s"])
    if u: print(f"step seq {seq:>5} pytorch useful rate {u}")
print(f"step: each figure the best of {max(1, len(rows('step_torch.json')) // max(1, len(peers)))} interleaved rounds")
for h in best(rows("step_halyard.json"), lambda r: (r["seq"], r["model"])).values():
    t = peers.get(h["seq"])
    if not t: continue
    print(f"step seq {h['seq']:>5} {h['model']:<22} halyard {h['tokens_per_s']:8.0f} tok/s, pytorch {t['tokens_per_s']:8.0f} tok/s "
          f"(torch {t['torch']}, {t['blas']}, {t['attention']}): {h['tokens_per_s'] / t['tokens_per_s']:.2f}x; "
          f"peak RSS {h['peak_rss_mib']:.0f} vs {t['peak_rss_mib']:.0f} MiB ({h['peak_rss_mib'] / t['peak_rss_mib']:.2f}x; "
          f"{h['peak_rss_mib'] / max(1.0, t['peak_rss_mib'] - t.get('import_rss_mib', 0)):.2f}x of torch's peak above its import)")
    u = useful(h["seq"], h["tokens_per_s"])
    if u: print(f"{'':16}halyard useful rate {u}")
PY
