#!/usr/bin/env bash
# llama_train on a GPU library, end to end (ctest: train_device). The device
# library is the OpenCL build of the micro Llama (the GPU loop schedule), run
# by PoCL on the CPU through the executor's device path; the peer is the same
# model's CPU library, trained by the same program:
#   train_device_check.sh <trainer of the device library> <trainer of the CPU library> <mpirun>
# - 1 rank, 6 steps: the update runs on the device (the header says so), and
#   the losses equal the CPU library's within 1e-4;
# - stopped at step 3 and resumed: steps 4-6 equal the uninterrupted run's,
#   bitwise (the moments went home into the checkpoint and back up); the CPU
#   trainer resumes the device's checkpoint within 1e-4 of its own run;
# - --lr 1e30: exit 2 naming step 2 and a tensor, step 1 stays the latest
#   checkpoint (the device update applies nothing once the norm is not finite);
# - 2 ranks (dp 2), plain AdamW on the device and ZeRO-1 on the host: the
#   CPU library's losses within 1e-4.
set -uo pipefail
dev=$1 cpu=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpi=("$mpirun" --allow-run-as-root --oversubscribe)
fail() { echo "FAIL: $*"; exit 1; }
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
# same <a> <b> <what> <steps>: two lists of "step loss" agree within 1e-4, relative
same() {
  paste "$1" "$2" | awk -v what="$3" -v n="$4" '
    { d = $2 - $4; if (d < 0) d = -d; r = d / $2; if (r > worst) worst = r; print what " step " $1 ": " $2 " vs " $4 }
    END { printf "%s: worst relative difference %.2e\n", what, worst; exit !(NR == n && worst <= 1e-4) }'
}

out=$("$dev" --steps 6 --metrics "$work/dev.jsonl" 2>&1) || fail "device run: $out"
grep -q "AdamW on the device" <<<"$out" || fail "the update did not run on the device: $out"
grep -qE "^done: .*; device memory [0-9.]+ MiB on rank 0$" <<<"$out" || fail "no device memory in: $out"
grep -E "^llama_micro_opencl|^done" <<<"$out"
"$cpu" --steps 6 --metrics "$work/cpu.jsonl" >/dev/null || fail "CPU run"
same <(losses "$work/dev.jsonl") <(losses "$work/cpu.jsonl") "device vs CPU library" 6 || fail "device losses differ"

"$dev" --steps 6 --save "$work/ck" --save-every 3 --metrics /dev/null >/dev/null || fail "device run that saves"
"$dev" --steps 6 --resume "$work/ck/step-00000003" --metrics "$work/resumed.jsonl" >/dev/null || fail "device resume"
want=$(losses "$work/dev.jsonl" | tail -3) got=$(losses "$work/resumed.jsonl")
echo "device uninterrupted steps 4-6: $(echo $want)"
echo "device resumed       steps 4-6: $(echo $got)"
[ -n "$got" ] && [ "$want" = "$got" ] || fail "resumed losses differ"
"$cpu" --steps 6 --resume "$work/ck/step-00000003" --metrics "$work/cpu_resumed.jsonl" >/dev/null \
  || fail "the CPU trainer resuming the device's checkpoint"
same <(losses "$work/cpu.jsonl" | tail -3) <(losses "$work/cpu_resumed.jsonl") \
  "CPU resuming the device's checkpoint" 3 || fail "CPU resume of the device's checkpoint"

out=$("$dev" --steps 4 --lr 1e30 --save "$work/nan" --save-every 1 2>&1); [ $? -eq 2 ] || fail "--lr 1e30 ran: $out"
grep -qE "^error: step 2, rank 0: (the loss is (NaN|[+-]inf)|a gradient is not finite); the first non-finite tensor is [a-z_./0-9]+\[[0-9]+\] = (NaN|[+-]inf)\.$" <<<"$out" \
  || fail "no error naming step 2, rank 0 and a tensor: $out"
[ "$(cat "$work/nan/latest")" = "step-00000001" ] || fail "latest is $(cat "$work/nan/latest")"
[ ! -e "$work/nan/step-00000002" ] || fail "a checkpoint of step 2 was written"
grep "^error" <<<"$out"

for zero in 0 1; do
  "${mpi[@]}" -np 2 "$dev" --steps 4 --sp 1 --zero $zero --metrics "$work/dev2_$zero.jsonl" >"$work/dev2.log" 2>&1 \
    || fail "device, 2 ranks, zero $zero: $(cat "$work/dev2.log")"
  if [ $zero = 0 ]; then grep -q "AdamW on the device" "$work/dev2.log" || fail "2 ranks: not on the device"; fi
  "${mpi[@]}" -np 2 "$cpu" --steps 4 --sp 1 --zero $zero --metrics "$work/cpu2_$zero.jsonl" >/dev/null \
    || fail "CPU, 2 ranks, zero $zero"
  same <(losses "$work/dev2_$zero.jsonl") <(losses "$work/cpu2_$zero.jsonl") "2 ranks, zero $zero" 4 || fail "2-rank losses differ (zero $zero)"
done
