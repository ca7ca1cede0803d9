#!/usr/bin/env bash
# Plan accuracy: the plan's predicted peak memory and step time per rank
# against what the ranks measure, on this machine's CPU ranks. Prints figures;
# asserts nothing.
#
#   bash scripts/plan_accuracy.sh            # STEPS=4 training steps per configuration
#
# 1. Builds the tiny Llama at 4,096 and 16,384 tokens for 1, 2 and 4 ranks
#    under two schedule families (recompute: cheap values inlined, Ulysses on
#    2 and 4 ranks; checkpoint_tiled: checkpointing and sequence tiles of 1,024)
#    and for 2 and 4 ranks under a third (ring_zigzag: zigzag ring attention,
#    every value saved), a trainer per family and length, and halyard-calibrate
#    over a fourth family (default / ulysses: every value saved) at both
#    lengths and a fifth (checkpoint, untiled, whose backward computes the
#    attention's log-sum-exp alone) at 4,096 tokens (bench/CMakeLists.txt).
# 2. Calibrates on 1, 2 and 4 ranks (profiles in build/plan_accuracy/): the
#    kernels' coefficients and the process baseline come from those, so no
#    predicted row was fitted on its own libraries.
# 3. For each of the 16 configurations: the plan (llama_aot --plan-only with
#    the profile of that rank count), then STEPS training steps under mpirun;
#    measured peak = the largest rank's peak RSS, measured step = the median of
#    the steps after the first.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
steps=${STEPS:-4}
bash "$root/scripts/configure.sh"
source "$root/.venv/halyard.env"
families=(recompute checkpoint_tiled ring_zigzag)
seqs=(4096 16384)
targets=(llama_aot acc_calibrate)
for f in "${families[@]}"; do for s in "${seqs[@]}"; do targets+=("acc_train_${f}_s$s"); done; done
"$HALYARD_CMAKE" --build "$root/build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
bin=$root/build/bench
out=$root/build/plan_accuracy
mkdir -p "$out"
# Unbound: Open MPI pins one or two ranks to one core each, which would halve
# a single rank's two threads.
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
config=$root/examples/llama/configs/tiny.json
# Text long enough for a 16,384-token row: the bundled corpus, repeated (the
# figures measured here do not depend on what the tokens say).
data=$out/corpus_x8.txt
for _ in 1 2 3 4 5 6 7 8; do cat "$root/examples/llama/data/corpus.txt"; done >"$data"

echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; MPI: $(mpirun --version | head -1)"
for r in 1 2 4; do
  "${mpi[@]}" -np $r "$bin/acc_calibrate" --out "$out/profile_r$r.json" --steps 4 --data "$data" | sed 's/^/  /'
done

rows=$out/rows.jsonl
: >"$rows"
for f in "${families[@]}"; do
  for s in "${seqs[@]}"; do
    for r in 1 2 4; do
      if [ $f = ring_zigzag ]; then
        [ $r = 1 ] && continue  # (a ring needs two ranks)
        sched=ring_zigzag
      elif [ $r = 1 ]; then sched=$root/examples/llama/schedules/$f.json; else sched=$root/examples/llama/schedules/ulysses_$f.json; fi
      tag=${f}_s${s}_r$r
      "$root/build/examples/llama/llama_aot" --name "acc_$tag" --config "$config" --schedule "$sched" --seq "$s" \
        --sp $r --cluster "$out/profile_r$r.json" --plan-only --plan-json "$out/$tag.plan.json" >"$out/$tag.plan.txt"
      rm -f "$out/$tag.metrics.jsonl"
      "${mpi[@]}" -np $r "$bin/acc_train_${f}_s$s" --steps "$steps" --sp $r --data "$data" --metrics "$out/$tag.metrics.jsonl" \
        >"$out/$tag.train.txt"
      python3 - "$out/$tag.plan.json" "$out/$tag.metrics.jsonl" "$f" "$s" "$r" >>"$rows" <<'PY'
import json, statistics, sys
plan = json.load(open(sys.argv[1]))
steps = [json.loads(l) for l in open(sys.argv[2]) if l.startswith('{"step"')]
print(json.dumps({"family": sys.argv[3], "seq": int(sys.argv[4]), "ranks": int(sys.argv[5]),
                  "pred_peak": plan["predicted_peak_bytes_per_rank"], "pred_step": plan["predicted_step_s"],
                  "meas_peak": max(steps[-1]["peak_rss_bytes"]),
                  "meas_step": statistics.median(s["step_s"] for s in steps[1:])}))
PY
      echo "  measured $tag" >&2
    done
  done
done

python3 - "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
mib = 1 << 20
print("\n%-18s %6s %5s | %9s %9s %7s | %9s %9s %7s" % ("schedule family", "seq", "ranks", "peak pred", "measured", "error",
                                                         "step pred", "measured", "error"))
mem_err, time_err = [], []
for r in rows:
    me = (r["pred_peak"] - r["meas_peak"]) / r["meas_peak"]
    te = (r["pred_step"] - r["meas_step"]) / r["meas_step"]
    mem_err.append(me); time_err.append(te)
    print("%-18s %6d %5d | %7.1f M %7.1f M %+6.1f%% | %8.3fs %8.3fs %+6.1f%%" % (r["family"], r["seq"], r["ranks"],
          r["pred_peak"] / mib, r["meas_peak"] / mib, 100 * me, r["pred_step"], r["meas_step"], 100 * te))
abs_mem = [abs(e) for e in mem_err]
print("\npeak memory: max |error| %.1f%% (target 5%%), median %.1f%% (target 3%%), worst under-prediction %.1f%% (target 2%%)"
      % (100 * max(abs_mem), 100 * statistics.median(abs_mem), -100 * min(0, min(mem_err))))
print("step time: MAPE %.1f%% (target 15%%)" % (100 * statistics.mean(abs(e) for e in time_err)))
pred = sorted(range(len(rows)), key=lambda i: rows[i]["pred_step"])
meas = sorted(range(len(rows)), key=lambda i: rows[i]["meas_step"])
same = sum(p == m for p, m in zip(pred, meas))
pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))]
agree = sum((rows[i]["pred_step"] < rows[j]["pred_step"]) == (rows[i]["meas_step"] < rows[j]["meas_step"]) for i, j in pairs)
print("ranking by step time: %s (%d of %d positions agree; %d of %d pairs ordered alike)"
      % ("identical" if pred == meas else "differs", same, len(rows), agree, len(pairs)))
PY
