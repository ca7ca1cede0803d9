#!/usr/bin/env bash
# Longest trainable context, measured: the tiny Llama on this machine's CPU
# ranks with MEMORY_PER_RANK bytes per rank (default 128 MiB), for
#   default             1 rank, nothing recomputed, no tiles
#   ulysses             4 ranks, Ulysses, nothing recomputed, no tiles
#   ulysses_checkpoint  4 ranks, Ulysses, every layer checkpointed
#   autosp              4 ranks, the schedule the AutoSP search chooses
# Prints figures; asserts nothing.
#
#   bash scripts/max_context.sh
#
# 1. Calibrates this machine on 1 and 4 ranks (halyard-calibrate on the
#    llama_train libraries), so the plans below predict with its coefficients
#    and its measured process baseline.
# 2. Asks halyard-plan for each family's longest sequence that fits (and
#    autosp's schedule there).
# 3. Measures: builds each family's library at the predicted length L and at
#    1.05 L (bench/CMakeLists.txt, HALYARD_MAX_CONTEXT_CASES) and trains two
#    steps of each. "Fits" means both steps ran and every rank's peak RSS is
#    within the budget. A bracket that did not close to 2.5% moves (5% down
#    when L does not fit, 5% up when 1.05 L does) or is halved, for at most
#    three more rounds. The target's own length, 16 times one rank's
#    longest, is measured too where autosp's bracket straddles it or
#    autosp fits beyond it, and its highest rank's peak printed with the
#    budget's margin left there.
# 4. At the longest length every family fits, the tokens/s of each, with
#    autosp choosing again for that length.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
budget=${MEMORY_PER_RANK:-134217728}
bash "$root/scripts/configure.sh" >/dev/null
source "$root/.venv/halyard.env"
build=$root/build
"$HALYARD_CMAKE" -S "$root" -B "$build" -DHALYARD_MAX_CONTEXT_CASES= >/dev/null
out=$build/max_context
mkdir -p "$out"
"$HALYARD_CMAKE" --build "$build" -j "$(nproc)" --target llama_aot halyard-plan halyard-calibrate >/dev/null
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
config=$root/examples/llama/configs/tiny.json
data=$out/corpus_x64.txt
for _ in $(seq 64); do cat "$root/examples/llama/data/corpus.txt"; done >"$data"
started=$(date +%s)

echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; MPI: $(mpirun --version | head -1); budget $((budget >> 20)) MiB per rank"
for r in 1 4; do
  "${mpi[@]}" -np $r "$build/examples/llama/halyard-calibrate" --out "$out/profile_r$r.json" --steps 4 --data "$data" >/dev/null
done

plan=("$build/examples/llama/halyard-plan" --config "$config" --memory-per-rank "$budget" --seq max --zero 1 --precision f32
  --seq-step 128)
"${plan[@]}" --cluster "$out/profile_r1.json" --ranks 1 --families default --json "$out/pred_r1.json" >"$out/pred_r1.txt"
"${plan[@]}" --cluster "$out/profile_r4.json" --ranks 4 --families ulysses,ulysses_checkpoint,autosp \
  --json "$out/pred_r4.json" >"$out/pred_r4.txt"
sed -n '/^longest trainable/,/^$/p' "$out/pred_r4.txt"

# family -> ranks, predicted length and schedule file
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for r, f in ((1, "pred_r1.json"), (4, "pred_r4.json")):
    for fam in json.load(open(f"{out}/{f}"))["families"]:
        if not fam["applies"]:
            sys.exit(f"{fam['family']}: {fam['reason']}")
        json.dump(fam["schedule"], open(f"{out}/{fam['family']}.schedule.json", "w"), indent=2)
        rows[fam["family"]] = {"ranks": r, "predicted": fam["longest_seq"], "pred_peak": fam["peak_bytes_per_rank"],
                               "pred_step": fam["step_s"], "sp": fam["schedule"]["mesh"]["sp"]}
json.dump(rows, open(f"{out}/families.json", "w"), indent=2)
PY

families=(default ulysses ulysses_checkpoint autosp)
step=128
# Builds and runs (family, length) pairs; appends {"family", "seq", "fits", ...} to measured.jsonl.
measure() {
  local cases=() targets=()
  for fs in "$@"; do
    local f=${fs%:*} s=${fs#*:}
    local sp
    sp=$(python3 -c "import json; print(json.load(open('$out/families.json'))['$f']['sp'])")
    cases+=("${f}_s${s}|${s}|$out/${f}.schedule.json|${sp}")
    targets+=("mc_train_${f}_s${s}")
  done
  local list
  list=$(IFS=';'; echo "${cases[*]}")
  "$HALYARD_CMAKE" -S "$root" -B "$build" "-DHALYARD_MAX_CONTEXT_CASES=$list" >/dev/null
  "$HALYARD_CMAKE" --build "$build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
  for fs in "$@"; do
    local f=${fs%:*} s=${fs#*:}
    local r
    r=$(python3 -c "import json; print(json.load(open('$out/families.json'))['$f']['ranks'])")
    rm -f "$out/m_${f}_s$s.jsonl"
    local ok=1
    "${mpi[@]}" -np "$r" "$build/bench/mc_train_${f}_s$s" --steps 2 --data "$data" --metrics "$out/m_${f}_s$s.jsonl" \
      >"$out/m_${f}_s$s.txt" 2>&1 || ok=0
    python3 - "$out/m_${f}_s$s.jsonl" "$f" "$s" "$ok" "$budget" >>"$out/measured.jsonl" <<'PY'
import json, sys
path, fam, seq, ok, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
try:
    lines = [json.loads(l) for l in open(path)]
except FileNotFoundError:
    lines = []
steps = [l for l in lines if "step" in l and "peak_rss_bytes" in l]
dp = next((l["launch"]["dp"] for l in lines if "launch" in l), 1)
peak = max((max(s["peak_rss_bytes"]) for s in steps), default=0)
fits = ok and len(steps) == 2 and peak <= budget
tps = seq * dp / steps[-1]["step_s"] if steps else 0
print(json.dumps({"family": fam, "seq": seq, "fits": fits, "peak": peak, "step_s": steps[-1]["step_s"] if steps else None,
                  "tokens_per_s": tps}))
PY
    tail -1 "$out/measured.jsonl" >&2
  done
}
: >"$out/measured.jsonl"

round_to() { python3 -c "import math; print(max($step, int(round($1 / $step)) * $step))"; }
above() { python3 -c "import math; print(max($1 + $step, int(math.ceil($1 * 1.05 / $step)) * $step))"; }
pairs=()
for f in "${families[@]}"; do
  L=$(python3 -c "import json; print(json.load(open('$out/families.json'))['$f']['predicted'])")
  pairs+=("$f:$L" "$f:$(above "$L")")
done
measure "${pairs[@]}"

# Move brackets that did not close: L failed (try lower) or 1.05 L fit (try higher).
for round in 1 2 3; do
  pairs=()
  for f in "${families[@]}"; do
    next=$(python3 - "$out/measured.jsonl" "$f" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if r["family"] == sys.argv[2]]
fit = [r["seq"] for r in rows if r["fits"]]
miss = [r["seq"] for r in rows if not r["fits"] and (not fit or r["seq"] > max(fit))]
if fit and miss and min(miss) <= max(fit) * 1.025 + 128:
    print("")  # closed to 2.5%
elif not fit:
    print(int(min(miss) * 0.95))
elif not miss:
    print(int(max(fit) * 1.05) + 128)
else:
    print(int((max(fit) + min(miss)) / 2))
PY
)
    [ -n "$next" ] && pairs+=("$f:$(round_to "$next")")
  done
  [ ${#pairs[@]} -eq 0 ] && break
  measure "${pairs[@]}"
done

# The 16x target's own length: where autosp's bracket leaves it open (the
# bracket closes to 2.5%, so it can straddle the target), and where autosp
# fits beyond it (so that the margin at the target is a measured figure).
target=$(python3 - "$out/measured.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def fits(f):
    return max([r["seq"] for r in rows if r["family"] == f and r["fits"]], default=0)
t, a = 16 * fits("default"), fits("autosp")
miss = [r["seq"] for r in rows if r["family"] == "autosp" and not r["fits"] and r["seq"] > a]
done = any(r["family"] == "autosp" and r["seq"] == t for r in rows)
print(t if a and not done and (a > t or t < min(miss, default=t + 1)) else "")
PY
)
[ -n "$target" ] && measure "autosp:$target"

# Throughput where every family fits, autosp choosing for that length.
common=$(python3 - "$out/measured.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
best = {}
for r in rows:
    if r["fits"]:
        best[r["family"]] = max(best.get(r["family"], 0), r["seq"])
print(min(best.values()) if len(best) == 4 else 0)
PY
)
if [ "$common" -gt 0 ]; then
  "$build/examples/llama/halyard-plan" --config "$config" --memory-per-rank "$budget" --seq "$common" --zero 1 \
    --precision f32 --cluster "$out/profile_r4.json" --ranks 4 --families none --schedule-out "$out/autosp_at_common.schedule.json" \
    >"$out/autosp_at_common.txt"
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = json.load(open(f"{out}/families.json"))
s = json.load(open(f"{out}/autosp_at_common.schedule.json"))
rows["autosp_at_common"] = {"ranks": s["mesh"]["dp"] * s["mesh"]["sp"], "sp": s["mesh"]["sp"]}
json.dump(rows, open(f"{out}/families.json", "w"), indent=2)
PY
  pairs=()
  for f in ulysses ulysses_checkpoint autosp_at_common; do
    grep -q "\"family\": \"$f\", \"seq\": $common, \"fits\": true" "$out/measured.jsonl" || pairs+=("$f:$common")
  done
  [ ${#pairs[@]} -gt 0 ] && measure "${pairs[@]}"
fi

python3 - "$out" "$budget" "$common" "$(( $(date +%s) - started ))" <<'PY'
import json, sys
out, budget, common, took = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fams = json.load(open(f"{out}/families.json"))
rows = [json.loads(l) for l in open(f"{out}/measured.jsonl")]
mib = 1 << 20
print(f"\nlongest trainable sequence, tiny Llama, {budget // mib} MiB per rank (measured: two steps, every rank's peak RSS within the budget)")
print("%-20s %5s | %9s | %9s %9s | %8s | %s" % ("family", "ranks", "predicted", "fits", "not at", "pred err", "measured tokens/s at its longest"))
measured = {}
for f in ("default", "ulysses", "ulysses_checkpoint", "autosp"):
    fit = [r for r in rows if r["family"] == f and r["fits"]]
    miss = [r for r in rows if r["family"] == f and not r["fits"] and (not fit or r["seq"] > max(x["seq"] for x in fit))]
    top = max(fit, key=lambda r: r["seq"]) if fit else None
    lo = top["seq"] if top else 0
    hi = min(r["seq"] for r in miss) if miss else None
    measured[f] = lo
    pred = fams[f]["predicted"]
    err = (pred - lo) / lo * 100 if lo else float("nan")
    print("%-20s %5d | %9d | %9d %9s | %+7.1f%% | %s" % (f, fams[f]["ranks"], pred, lo, hi if hi else "-", err,
          "%.0f" % top["tokens_per_s"] if top else "-"))
a = measured["autosp"]
for f, target in (("ulysses", 3.0), ("default", 16.0), ("ulysses_checkpoint", 1.3)):
    if measured[f]:
        print("autosp / %-18s %6.2fx (target >= %.1fx)" % (f, a / measured[f], target))
t = 16 * measured["default"]
at_t = [r for r in rows if r["family"] == "autosp" and r["seq"] == t]
if t and at_t:
    r = at_t[-1]
    if r["peak"]:
        print("autosp at 16x one rank (%d tokens): %s; highest rank %.1f MiB of %d, margin %.1f MiB"
              % (t, "fits" if r["fits"] else "does not fit", r["peak"] / mib, budget // mib, (budget - r["peak"]) / mib))
    else:
        print("autosp at 16x one rank (%d tokens): did not run two steps (m_autosp_s%d.txt)" % (t, t))
if common:
    print(f"\ntokens/s at {common} tokens (the longest every family fits; autosp choosing for that length):")
    best = 0
    for f in ("default", "ulysses", "ulysses_checkpoint", "autosp_at_common"):
        r = [x for x in rows if x["family"] == f and x["seq"] == common and x["fits"]]
        if r:
            best = max(best, r[-1]["tokens_per_s"])
            print("  %-20s %8.0f" % (f, r[-1]["tokens_per_s"]))
    r = [x for x in rows if x["family"] == "autosp_at_common" and x["seq"] == common and x["fits"]]
    if r and best:
        print("  autosp is %.1f%% below the best (target within 5%%)" % (100 * (1 - r[-1]["tokens_per_s"] / best)))
print(f"\n(took {took} s)")
PY
