#!/usr/bin/env bash
# ctest calibrate_cli: halyard-calibrate on one rank over llama_train's
# libraries writes a profile whose kernel kinds all have coefficients; a kind
# those libraries never run takes the fit of the kind doing the same work
# (kernel_kind_stand_in): the log-sum-exp alone runs at the attention
# forward's rate, not at the memory's bandwidth (which made a recomputed
# log-sum-exp cost 0.6 ms in the plan against 900 ms measured at 16,384
# tokens). One rank waits on no other: its profile has no collective lag
# and says none; on two, halyard-calibrate fits the lag (how far behind the
# other rank is at a collective) and writes what it printed.
set -euo pipefail
calibrate=$1 mpiexec=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$mpiexec" --allow-run-as-root --oversubscribe -np 1 "$calibrate" --out "$work/profile.json" --steps 2 | tee "$work/out.txt"
grep -q "^  attention_lse: no calls in these libraries; attention's fit stands in$" "$work/out.txt" \
  || { echo "FAIL: halyard-calibrate did not say which fit stands in for attention_lse"; exit 1; }
python3 - "$work/profile.json" <<'PY'
import json, sys
k = json.load(open(sys.argv[1]))["kernels"]
want = ["contract", "contract_seq", "attention", "attention_lse", "attention_grad_q", "attention_grad_kv", "norm",
        "pointwise", "embedding", "loss", "copy"]
missing = [x for x in want if x not in k]
assert not missing, f"FAIL: no coefficients for {missing}"
assert k["attention_lse"] == k["attention"], f"FAIL: attention_lse {k['attention_lse']} is not attention's {k['attention']}"
# (Two calls of one shape cannot split the time between FLOPs and bytes;
# either way the fit charges something.)
assert k["attention"]["s_per_flop"] + k["attention"]["s_per_byte"] > 0, "FAIL: the attention forward's fit is free"
print("calibrate_cli: every kind has coefficients; attention_lse takes the attention forward's")
PY
grep -q "ranks behind" "$work/out.txt" && { echo "FAIL: one rank printed a lag behind other ranks"; exit 1; }
"$mpiexec" --allow-run-as-root --oversubscribe -np 2 "$calibrate" --out "$work/profile2.json" --steps 2 | tee "$work/out2.txt"
python3 - "$work/profile.json" "$work/profile2.json" "$work/out2.txt" <<'PY'
import json, re, sys
one, two = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert "collective_lag_s" not in one, f"FAIL: one rank fitted a lag {one['collective_lag_s']}"
m = re.search(r"^  ranks behind at a collective: up to ([0-9.]+) ms \(fitted over ([0-9]+) collectives waited on\)$",
              open(sys.argv[3]).read(), re.M)
assert m, "FAIL: two ranks did not print the lag they fitted"
assert int(m.group(2)) > 0, "FAIL: no collective waited on over two ranks"
lag_ms = 1e3 * two.get("collective_lag_s", 0.0)
assert abs(lag_ms - float(m.group(1))) <= 0.006, f"FAIL: the profile's lag {lag_ms} ms is not the {m.group(1)} ms printed"
print(f"calibrate_cli: two ranks lag {lag_ms:.3f} ms at a collective ({m.group(2)} waited on); one rank none")
PY
