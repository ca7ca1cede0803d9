#!/usr/bin/env bash
# ctest calibrate_cli: halyard-calibrate on one rank over llama_train's
# libraries writes a profile whose kernel kinds all have coefficients; a kind
# those libraries never run takes the fit of the kind doing the same work
# (kernel_kind_stand_in): the log-sum-exp alone runs at the attention
# forward's rate, not at the memory's bandwidth (which made a recomputed
# log-sum-exp cost 0.6 ms in the plan against 900 ms measured at 16,384
# tokens).
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
