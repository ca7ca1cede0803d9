#!/usr/bin/env bash
# llama_train under mpirun, end to end (ctest: train_mpi_<case>):
#   train_mpi_check.sh <llama_train> <mpirun> <case> [trainer options...]
#   resume   4 ranks: a run stopped at step 3 and resumed gives the losses of
#            the uninterrupted run, bitwise, with plain AdamW and with ZeRO-1
#            (whose checkpoint also resumes on 2 ranks).
#   ranks    1 rank vs 4 (sp 4) at the same global seq: the same losses within
#            1e-4; and dp 2 x sp 2 vs dp 2 x sp 1 (the same rows): the same.
#   gradreduce  4 ranks, gradients summed from bf16 (--grad-reduce bf16)
#            against f32: the losses within 1e-4; with ZeRO-1 and without
#            it the same losses (the same f32 sums of the same rounded
#            values); the header and the metrics say so; a bad value is an
#            error naming the legal ones.
#   killed   rank 1 is SIGKILLed mid-training: the job ends non-zero within
#            60 s, and the output names rank 1. Plain mpirun ends the job
#            itself; with --enable-recovery the survivors' communicator times
#            out (5 s) and reports the dead rank.
#   stepcheck  --step-check from one checkpoint on 1 rank and on 4 ranks
#            (sp 4): the same batch, loss and gradients within 1e-5 (with
#            the options after <case>, e.g. --pack 32: packed documents).
#   errors   a rank count without a library, a config or seq that does not
#            match the library, numbers that are not strictly numbers, an
#            unwritable --save directory (on 1 rank and on 2: every rank
#            stops at once), a validation split too small: exit 2 with the
#            fix; --help: the usage, exit 0.
#   nonfinite  --lr 1e30 makes the loss NaN at step 2: exit 2 naming the
#            step, the rank and the first non-finite tensor; the checkpoint
#            of step 1 stays the latest, and no later one is written.
#   validation  --val-every on a text with a held-out tail: validation lines
#            and "val_loss" in the metrics at the steps asked.
#   nccl     (llama_train_cuda_nccl: the tiny Llama's CUDA library, its steps
#            over NCCL) 2 ranks: without GPUs every rank stops within 60 s
#            naming the missing device and the fix; on one GPU, NCCL's one
#            GPU per rank; on two, 3 steps of dp 2 whose header says NCCL.
#   plan     (llama_train_planned: one library, sp 1, with a made-up plan) the
#            plan line before step 1; --metrics starts with the plan and the
#            launch, on 1 rank and on dp 2 x ZeRO-1; step lines carry exact
#            peak_rss_bytes per rank and step_s; --resume writes no plan line;
#            2 ranks without --sp name the one degree linked.
set -uo pipefail
train=$1 mpirun=$2 case=$3
shift 3
options=("$@")  # stepcheck: passed to both step-checks
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpi=("$mpirun" --allow-run-as-root --oversubscribe)
fail() { echo "FAIL: $*"; exit 1; }
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }

case $case in
resume)
  for zero in 0 1; do
    d=$work/z$zero
    "${mpi[@]}" -np 4 "$train" --steps 6 --zero $zero --metrics "$d.full.jsonl" >/dev/null || fail "uninterrupted run (zero=$zero)"
    "${mpi[@]}" -np 4 "$train" --steps 6 --zero $zero --save "$d" --save-every 3 --metrics /dev/null >/dev/null \
      || fail "run that saves (zero=$zero)"
    "${mpi[@]}" -np 4 "$train" --steps 6 --zero $zero --resume "$d/step-00000003" --metrics "$d.resumed.jsonl" \
      >/dev/null || fail "resumed run (zero=$zero)"
    want=$(losses "$d.full.jsonl" | tail -3) got=$(losses "$d.resumed.jsonl")
    echo "zero=$zero uninterrupted steps 4-6: $(echo $want)"
    echo "zero=$zero resumed       steps 4-6: $(echo $got)"
    [ -n "$got" ] && [ "$want" = "$got" ] || fail "resumed losses differ (zero=$zero)"
  done
  "${mpi[@]}" -np 2 "$train" --steps 6 --zero 1 --resume "$work/z1/step-00000003" --metrics "$work/two.jsonl" \
    >/dev/null || fail "ZeRO-1 checkpoint of 4 ranks resumed on 2"
  echo "zero=1 resumed on 2 ranks steps 4-6: $(echo $(losses "$work/two.jsonl"))"
  ;;
ranks)
  "$train" --steps 8 --metrics "$work/one.jsonl" >/dev/null || fail "1 rank"
  "${mpi[@]}" -np 4 "$train" --steps 8 --metrics "$work/four.jsonl" >/dev/null || fail "4 ranks"
  paste <(losses "$work/one.jsonl") <(losses "$work/four.jsonl") | awk '
    { d = $2 - $4; if (d < 0) d = -d; r = d / $2; if (r > worst) worst = r; print "step " $1 ": 1 rank " $2 ", 4 ranks " $4 }
    END { printf "worst relative difference %.2e\n", worst; exit !(NR == 8 && worst <= 1e-4) }' || fail "losses differ"
  "${mpi[@]}" -np 2 "$train" --steps 8 --sp 1 --metrics "$work/dp2.jsonl" >/dev/null || fail "dp 2 x sp 1"
  "${mpi[@]}" -np 4 "$train" --steps 8 --sp 2 --metrics "$work/dp2sp2.jsonl" >/dev/null || fail "dp 2 x sp 2"
  paste <(losses "$work/dp2.jsonl") <(losses "$work/dp2sp2.jsonl") | awk '
    { d = $2 - $4; if (d < 0) d = -d; r = d / $2; if (r > worst) worst = r; print "step " $1 ": dp 2 x sp 1 " $2 ", dp 2 x sp 2 " $4 }
    END { printf "worst relative difference %.2e\n", worst; exit !(NR == 8 && worst <= 1e-4) }' || fail "dp losses differ"
  ;;
gradreduce)
  for z in 0 1; do
    for g in f32 bf16; do
      "${mpi[@]}" -np 4 "$train" --steps 6 --zero $z --grad-reduce $g --metrics "$work/$z$g.jsonl" >"$work/$z$g.log" 2>&1 \
        || { cat "$work/$z$g.log"; fail "--zero $z --grad-reduce $g"; }
    done
  done
  grep -q "gradients summed from bf16" "$work/1bf16.log" || fail "no header line says the gradients are summed from bf16"
  grep -q '"grad_reduce":"bf16"' "$work/1bf16.jsonl" || fail "the metrics' launch line does not say grad_reduce bf16"
  ! grep -q "gradients summed from bf16" "$work/1f32.log" || fail "an f32 run says bf16"
  paste <(losses "$work/1f32.jsonl") <(losses "$work/1bf16.jsonl") | awk '
    { d = $2 - $4; if (d < 0) d = -d; r = d / $2; if (r > worst) worst = r; print "step " $1 ": f32 " $2 ", bf16 " $4 }
    END { printf "worst relative difference %.2e\n", worst; exit !(NR == 6 && worst <= 1e-4) }' || fail "losses differ"
  cmp <(losses "$work/0bf16.jsonl") <(losses "$work/1bf16.jsonl") || fail "ZeRO-1 and plain AdamW differ summed from bf16"
  if "$train" --steps 1 --grad-reduce fp8 >"$work/bad.log" 2>&1; then fail "--grad-reduce fp8 ran"; fi
  grep -q 'legal: f32, or bf16' "$work/bad.log" || { cat "$work/bad.log"; fail "--grad-reduce fp8: no legal values"; }
  ;;
killed)
  for mode in plain recovery; do
    extra=()
    [ $mode = recovery ] && extra=(--enable-recovery)
    log=$work/$mode.log
    start=$(date +%s)
    # The metrics path is unique to this job: it tells its ranks from those of
    # other tests running at the same time.
    marker=$work/$mode.jsonl
    "${mpi[@]}" "${extra[@]}" -np 2 "$train" --steps 3000 --warmup 1 --comm-timeout 5 --metrics "$marker" >"$log" 2>&1 &
    job=$!
    for _ in $(seq 600); do grep -q "^step    3/" "$log" && break; sleep 0.1; done
    grep -q "^step    3/" "$log" || fail "$mode: training never reached step 3: $(cat "$log")"
    victim=
    for p in $(pgrep -f -- "--metrics $marker"); do
      tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1 && victim=$p
    done
    [ -n "$victim" ] || fail "$mode: no process of rank 1"
    kill -9 "$victim"
    for _ in $(seq 600); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
    if kill -0 $job 2>/dev/null; then
      kill $job; sleep 2; pkill -9 -f -- "--metrics $marker"; kill -9 $job 2>/dev/null
      fail "$mode: still running 60 s after rank 1 died"
    fi
    wait $job; rc=$?
    secs=$(( $(date +%s) - start ))
    echo "--- $mode mpirun: exit $rc, ended within ${secs}s of start; its report:"
    grep -v "^step" "$log" | head -20
    if [ $mode = plain ]; then
      [ $rc -ne 0 ] || fail "plain: mpirun exited 0"
      grep -Eq "rank 1" "$log" || fail "plain: no message names rank 1"
    else
      grep -q "waiting for rank 1" "$log" || fail "recovery: the survivor did not name rank 1"
    fi
  done
  ;;
stepcheck)
  "$train" --steps 2 --save "$work/ck" >/dev/null || fail "training for the checkpoint"
  "$train" --resume "$work/ck" --step-check "$work/one.safetensors" "${options[@]}" || fail "step-check on 1 rank"
  "${mpi[@]}" -np 4 "$train" --resume "$work/ck" --step-check "$work/four.safetensors" "${options[@]}" ||
    fail "step-check on 4 ranks"
  python3 - "$work/one.safetensors" "$work/four.safetensors" <<'PY' || fail "step-checks differ"
import json, struct, sys
def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        fmt = {"F32": "f", "F64": "d", "I32": "i"}[t["dtype"]]
        out[name] = struct.unpack("<%d%s" % ((b - a) // struct.calcsize(fmt), fmt), data[a:b])
    return out
one, four = read(sys.argv[1]), read(sys.argv[2])
assert one.keys() == four.keys(), "different tensors"
for k in ("input_ids", "labels", "position_ids"):
    assert one[k] == four[k], k + " differs"
worst, which = 0.0, ""
for k in one:
    if k in ("input_ids", "labels", "position_ids"):
        continue
    scale = max(max(abs(x) for x in one[k]), 1e-30)
    err = max(abs(x - y) for x, y in zip(one[k], four[k])) / scale
    if err > worst:
        worst, which = err, k
print("step-check 1 rank vs 4 ranks: same batch; loss %.9g vs %.9g; worst relative difference %.2e (%s)"
      % (one["loss"][0], four["loss"][0], worst, which))
sys.exit(0 if worst <= 1e-5 else 1)
PY
  ;;
errors)
  out=$("${mpi[@]}" -np 3 "$train" --steps 1 2>&1) && fail "3 ranks ran"
  grep -q "links libraries for sp = 1, 2, 4" <<<"$out" || fail "3 ranks: $out"
  out=$("${mpi[@]}" -np 4 "$train" --steps 1 --sp 3 2>&1) && fail "--sp 3 on 4 ranks ran"
  grep -q "does not divide the 4 ranks" <<<"$out" || fail "--sp 3: $out"
  out=$("$train" --steps 1 --seq 333 2>&1); [ $? -eq 2 ] || fail "--seq 333 ran"
  grep -q "was built for seq" <<<"$out" || fail "--seq: $out"
  out=$("$train" --steps 1 --config "$(dirname "$0")/../fixtures/llama_micro.json" 2>&1); [ $? -eq 2 ] || fail "--config ran"
  grep -q "does not match the model library" <<<"$out" || fail "--config: $out"
  out=$("$train" --steps 1 --zero 1 2>&1); [ $? -eq 2 ] || fail "--zero on one rank ran"
  grep -q "this is one rank" <<<"$out" || fail "--zero: $out"
  for bad in "--steps 1e9" "--steps -1" "--steps 4x" "--lr nan" "--clip -1" "--seed 1.5" "--zero 2" "--threads -2"; do
    out=$("$train" $bad 2>&1); [ $? -eq 2 ] || fail "$bad ran"
    grep -qE "is not a (whole|finite) number" <<<"$out" || fail "$bad: $out"
  done
  out=$("$train" --help) || fail "--help exited non-zero"
  grep -q "^usage: llama_train" <<<"$out" && grep -q -- "--val-every N" <<<"$out" || fail "--help: $out"
  touch "$work/file"
  out=$("$train" --steps 1 --save "$work/file/ck" 2>&1); [ $? -eq 2 ] || fail "unwritable --save ran"
  grep -qF "error: --save \"$work/file/ck\" cannot be written: Not a directory." <<<"$out" \
    && grep -qF "checked before step 1" <<<"$out" || fail "--save: $out"
  start=$(date +%s)
  out=$("${mpi[@]}" -np 2 "$train" --steps 1 --save "$work/file/ck" 2>&1) && fail "unwritable --save on 2 ranks ran"
  grep -qF "rank 1: error: stopped: rank 0 failed a check" <<<"$out" && grep -qF "rank 0: error: --save" <<<"$out" \
    || fail "--save on 2 ranks: $out"
  [ $(($(date +%s) - start)) -lt 30 ] || fail "--save on 2 ranks took past 30 s: the other rank waited for a timeout"
  out=$("$train" --steps 1 --val-every 1 2>&1); [ $? -eq 2 ] || fail "a validation split of 196 tokens ran"
  grep -qF "each split needs at least seq + 1 = 1025" <<<"$out" || fail "--val-every: $out"
  echo "errors: all reported with exit 2; --help exits 0"
  ;;
nonfinite)
  out=$("$train" --steps 4 --lr 1e30 --save "$work/ck" --save-every 1 2>&1); [ $? -eq 2 ] || fail "--lr 1e30 ran: $out"
  grep -qE "^error: step 2, rank 0: the loss is (NaN|[+-]inf); the first non-finite tensor is [a-z_./0-9]+\[[0-9]+\] = (NaN|[+-]inf)\.$" <<<"$out" \
    || fail "no error naming step 2, rank 0 and a tensor: $out"
  grep -qF "no checkpoint holding non-finite values is written" <<<"$out" || fail "$out"
  [ "$(cat "$work/ck/latest")" = "step-00000001" ] || fail "latest is $(cat "$work/ck/latest")"
  [ ! -e "$work/ck/step-00000002" ] || fail "a checkpoint of step 2 was written"
  echo "$out" | grep "^error"
  ;;
validation)
  for _ in 1 2 3 4 5 6 7 8 9 10; do cat "$(dirname "$0")/../../examples/llama/data/corpus.txt"; done >"$work/text.txt"
  out=$("$train" --steps 4 --data "$work/text.txt" --val-every 2 --val-fraction 0.3 --val-batches 1 \
        --metrics "$work/m.jsonl" 2>&1) || fail "$out"
  grep -q "^validation: the last 11772 tokens of" <<<"$out" || fail "no validation line: $out"
  [ "$(grep -c "validation loss" <<<"$out")" = 2 ] || fail "not 2 validation losses: $out"
  [ "$(grep -c '"val_loss":' "$work/m.jsonl")" = 2 ] && grep -q '"step":4,.*"val_loss":' "$work/m.jsonl" \
    || fail "metrics: $(cat "$work/m.jsonl")"
  grep "validation loss" <<<"$out"
  ;;
plan)
  out=$("$train" --steps 2 --save "$work/ck" --metrics "$work/one.jsonl") || fail "1 rank: $out"
  want="plan: predicted peak 40.0 MiB per rank (params: 3.0, arena: 8.0), predicted step 0.5 s"
  grep -qxF "$want" <<<"$out" || fail "1 rank: no line \"$want\" in: $out"
  [ "$(grep -n '^plan:' <<<"$out" | cut -d: -f1)" -lt "$(grep -n '^step    1/' <<<"$out" | cut -d: -f1)" ] \
    || fail "the plan line comes after step 1"
  head -1 "$work/one.jsonl" | grep -q '^{"plan":{"predicted_peak_bytes_per_rank":41943040,.*"schedule":"recompute"},"launch":{"ranks":1,"dp":1,"sp":1,"zero":0,"grad_reduce":"f32","threads_per_rank":[1-9][0-9]*}}$' \
    || fail "1 rank: first metrics line: $(head -1 "$work/one.jsonl")"
  sed -n 2p "$work/one.jsonl" | grep -q '^{"step":1,"loss":.*"peak_rss_mib":\[[0-9]*\],"peak_rss_bytes":\[[1-9][0-9]*\],"step_s":[0-9.e-]*}$' \
    || fail "1 rank: step line: $(sed -n 2p "$work/one.jsonl")"
  echo "1 rank: $(head -1 "$work/one.jsonl")"
  echo "        $(sed -n 2p "$work/one.jsonl")"
  "$train" --steps 3 --resume "$work/ck/step-00000002" --metrics "$work/resumed.jsonl" >/dev/null || fail "resume"
  head -1 "$work/resumed.jsonl" | grep -q '^{"step":3,' || fail "resumed: first line: $(head -1 "$work/resumed.jsonl")"
  out=$("${mpi[@]}" -np 2 "$train" --steps 1 --sp 1 --zero 1 --metrics "$work/two.jsonl") || fail "2 ranks: $out"
  head -1 "$work/two.jsonl" | grep -q '"launch":{"ranks":2,"dp":2,"sp":1,"zero":1,' \
    || fail "2 ranks: first metrics line: $(head -1 "$work/two.jsonl")"
  sed -n 2p "$work/two.jsonl" | grep -q '"peak_rss_bytes":\[[1-9][0-9]*,[1-9][0-9]*\],"step_s":' \
    || fail "2 ranks: step line: $(sed -n 2p "$work/two.jsonl")"
  echo "2 ranks: $(head -1 "$work/two.jsonl" | grep -o '"launch".*')"
  out=$("${mpi[@]}" -np 2 "$train" --steps 1 2>&1) && fail "2 ranks along the sequence ran"
  grep -qF "links libraries for sp = 1 only." <<<"$out" && grep -qF "fix: pass --sp 1 (" <<<"$out" \
    && grep -qF "halyard_add_llama_train(NAME llama_train_planned MODELS ...)" <<<"$out" || fail "2 ranks: $out"
  ;;
nccl)
  # (llama_train_cuda_nccl: a CUDA library, steps over NCCL.) Without two
  # GPUs the NCCL bootstrap stops every rank at once with the reason and the
  # fix; with them, dp 2 trains and says its steps run over NCCL.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  start=$(date +%s)
  out=$(timeout 120 "${mpi[@]}" -np 2 "$train" --steps 3 --sp 1 --zero 0 2>&1)
  rc=$?
  took=$(($(date +%s) - start))
  if [ "${gpus:-0}" -ge 2 ]; then
    [ $rc -eq 0 ] || fail "2 ranks on $gpus GPUs: exit $rc: $out"
    grep -q "steps over NCCL" <<<"$out" || fail "no NCCL in the header: $out"
    grep -E "^step +3 " <<<"$out" || fail "no step 3: $out"
  elif [ "${gpus:-0}" -eq 1 ]; then
    [ $rc -ne 0 ] || fail "2 ranks on one GPU ran"
    grep -q "NCCL needs one GPU per rank" <<<"$out" || fail "one GPU: $out"
  else
    [ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "2 ranks without a GPU: exit $rc: $out"
    grep -q "error: NCCL communicator on rank [01]: no CUDA device" <<<"$out" \
      && grep -q "fix: run on GPU nodes or use make_mpi_communicator()" <<<"$out" || fail "no GPU: $out"
    [ $took -lt 60 ] || fail "no GPU: the ranks took $took s to stop (a timeout, not the bootstrap's check)"
  fi
  grep -m1 "error:" <<<"$out" || true
  ;;
*) fail "unknown case $case" ;;
esac
echo PASS
