#!/usr/bin/env bash
# ctest fit_kernels_cli: halyard-fit-kernels over a profile made from a real
# plan (gpu_tiny_bf16_s8192's) with known kernel times per kind: the profile
# it writes must give those coefficients back, keep the base preset's
# memory and links, and load in halyard-plan; bad input is a clear error.
set -euo pipefail
fit=$1 plan_cli=$2 plan=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Contractions at 400 TFLOP/s charged + 5 us a call, attention at 200 + 10 us,
# everything else at 2 TB/s + 4 us: the profile of one step, a line per stage
# as Model::profile() writes it (plus a wait line, which times no kernel).
python3 - "$plan" >"$work/step.profile.txt" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
for i, s in enumerate(plan["stages"]):
    k = s["kind"]
    if k.startswith("contract"):
        t = s["charged_flops"] / 400e12 + 5e-6
    elif k.startswith("attention"):
        t = s["charged_flops"] / 200e12 + 10e-6
    else:
        t = s["bytes"] / 2e12 + 4e-6
    print(f"  {t * 1e3:.9f} ms  lib_k{i}  {s['label']}  scratch 0")
print("  0.5 ms  wait all_to_all  all_to_all %1 model.layers.0.self_attn")
PY
"$fit" --base 8xH100-80GB --out "$work/fitted.json" "$plan" "$work/step.profile.txt" | tee "$work/out.txt"
python3 - "$work/fitted.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
def near(got, want, what):
    if abs(got - want) > 1e-3 * want:
        sys.exit(f"FAIL: {what} {got} against {want}")
assert c["name"] == "8xH100-80GB+fitted", c["name"]
assert c["device"] == "cuda" and "fitted by halyard-fit-kernels" in c["source"], c["source"]
k = c["kernels"]
near(k["contract"]["s_per_flop"], 1 / 400e12, "contract s/flop")
near(k["contract"]["s_per_call"], 5e-6, "contract s/call")
near(k["pointwise"]["s_per_byte"], 1 / 2e12, "pointwise s/byte")
near(k["pointwise"]["s_per_call"], 4e-6, "pointwise s/call")
near(c["memory_per_rank_bytes"], 80 * 2**30, "memory per rank (the base's)")
print("fitted coefficients: as made")
PY
grep -q "kernels .* s measured, .* s predicted by 8xH100-80GB, .* s by the fit" "$work/out.txt"
"$plan_cli" --model tiny --cluster "$work/fitted.json" --ranks 1 --seq 8192 --families none >"$work/plan.txt"
grep -q "8xH100-80GB+fitted" "$work/plan.txt" || { echo "FAIL: halyard-plan did not plan with the fitted profile"; cat "$work/plan.txt"; exit 1; }

# Bad input: an odd number of files, a profile of another library.
if "$fit" --base 8xH100-80GB --out "$work/x.json" "$plan" 2>"$work/err.txt"; then echo "FAIL: one file accepted"; exit 1; fi
grep -q "legal: pairs of PLAN.json PROFILE.txt" "$work/err.txt"
echo "  1.0 ms  k0  embedding %999999 model.embed_tokens" >"$work/other.txt"
if "$fit" --base 8xH100-80GB --out "$work/x.json" "$plan" "$work/other.txt" 2>"$work/err.txt"; then echo "FAIL: a foreign profile accepted"; exit 1; fi
grep -q "the profile has no call of stage" "$work/err.txt"
echo "fit_kernels_cli: passed"
