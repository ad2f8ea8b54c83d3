#!/usr/bin/env bash
# One check of a GPU node with vLLM's CUDA build (make install EXTRAS=gpu,dev):
#   1. batchllm doctor, cold        platform, node checks, vLLM, GPUs, a real start (compiles, captures
#                                   graphs), 16 answers
#   2. batchllm doctor, warm        the same start from the compile cache: what every later process pays
#   3. bench --shape nested         fp32, batch-invariant on GPUs: ratios, and answers equal across runs
#   4. a tensor-parallel start      doctor with --tensor-parallel-size 2, when 2 GPUs are visible
#   5. bench --scheduler-only       our cost per step at this node's batch size (doctor's max_num_seqs)
# Both doctors start vLLM with the dtype and batch-invariant mode the bench runs (fp32 with batch
# invariance turns vLLM's AOT compile off: a start in other settings would not warm the bench's).
# Each step has its own time limit, past which its whole process group (vLLM's engine core and
# workers included) is killed; one that fails is recorded (exit code, stderr tail) and the next runs.
# The default limits add up to at most 20 minutes (COLD_S 420, WARM_S 180, bench at most BENCH_S 300,
# TP_S 240, 60 for the scheduler); the bench's is sized from the warm start doctor measured (each
# bench run is a fresh process that starts vLLM), and the report says which limits applied and why.
# Each step's result is kept as it finishes (OUT.steps/), and OUT is written again after every step
# and on any exit, so an interrupted check still ends with what it measured.
# benchmarks/gpu_check.sh [OUT.json] (default gpu_check.json).
# MODEL=smollm2 (default; a built-in, or any local checkpoint) PYTHON=.venv/bin/python (default).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.json}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
STEPS="${OUT%.json}.steps"
rm -rf "$STEPS" && mkdir -p "$STEPS"
started=$(date +%s)
COLD_S=${COLD_S:-420}
WARM_S=${WARM_S:-180}
BENCH_S=${BENCH_S:-300}
TP_S=${TP_S:-240}
batch=1024
LIMITS="{}"

limit() {  # limit NAME SECONDS WHY: recorded for the report
  LIMITS=$("$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); d[sys.argv[2]] = [int(sys.argv[3]), sys.argv[4]]; print(json.dumps(d))' \
    "$LIMITS" "$1" "$2" "$3")
}

report() {  # OUT from every step finished so far
  "$PY" - "$STEPS" "$OUT" "$started" "${gpus:-0}" "$batch" "$LIMITS" <<'EOF'
import json, pathlib, sys, time

steps, out, started, gpus, batch = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
limits = json.loads(sys.argv[6])
report = {"seconds": int(time.time()) - started, "gpus": int(gpus or 0), "batch_size_checked": int(batch), "steps": {}}
for rc in sorted(steps.glob("*.rc"), key=lambda p: p.stat().st_mtime):
    name = rc.stem
    text = (steps / f"{name}.json").read_text()
    try:
        result = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        result = {"unparsed_stdout": text[-2000:]}
    code = int(rc.read_text() or 1)
    limit, why = limits.get(name, [None, ""])
    report["steps"][name] = {"exit_code": code, "result": result, "limit_s": limit, "limit_why": why,
                             "timed_out": code == 124, "stderr_tail": (steps / f"{name}.err").read_text()[-3000:]}
report["ok"] = bool(report["steps"]) and all(step["exit_code"] == 0 for step in report["steps"].values())
pathlib.Path(out).write_text(json.dumps(report, indent=2))
print(f"gpu_check: {len(report['steps'])} steps, {'all passed' if report['ok'] else 'a step failed'} in "
      f"{report['seconds']}s -> {out}", file=sys.stderr)
sys.exit(0 if report["ok"] else 1)
EOF
}
trap 'report >/dev/null 2>&1' EXIT  # whatever ends the script, OUT holds every step that finished

step() {  # step NAME SECONDS COMMAND...: stdout to NAME.json, stderr to NAME.err, exit code to NAME.rc
  local name=$1 seconds=$2
  shift 2
  echo "gpu_check: $name (at most ${seconds}s)" >&2
  # A session of its own: past its limit the whole group goes, vLLM's engine core and workers included.
  setsid "$@" >"$STEPS/$name.json" 2>"$STEPS/$name.err" &
  local pid=$! waited=0 code
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$seconds" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    code=124
  else
    wait "$pid"; code=$?
  fi
  echo "$code" >"$STEPS/$name.rc"
  report >/dev/null 2>&1 || true
}

"$PY" -m engine.cli.main prepare-model "$MODEL" >/dev/null 2>&1 || true  # a built-in is prepared once (no-op for a path)
# The GPUs this process may use (CUDA_VISIBLE_DEVICES), not the node's.
gpus=$("$PY" -c 'from engine.gpus import visible_gpus; print(len(visible_gpus()))' 2>/dev/null || echo 0)
# vLLM's batch-invariant mode is Triton kernels, GPUs only; on a CPU (a dry run of this script) fp32
# answers do not depend on the batch anyway.
invariant=$([ "${gpus:-0}" -ge 1 ] && echo --batch-invariant)
as_bench=(env "VLLM_BATCH_INVARIANT=$([ -n "$invariant" ] && echo 1 || echo 0)")
limit doctor_cold "$COLD_S" "COLD_S: a first start compiles and captures graphs"
step doctor_cold "$COLD_S" "${as_bench[@]}" "$PY" -m engine.cli.main doctor --model "$MODEL" --dtype float32 --json
limit doctor "$WARM_S" "WARM_S: a start from the compile cache the cold one filled"
step doctor "$WARM_S" "${as_bench[@]}" "$PY" -m engine.cli.main doctor --model "$MODEL" --dtype float32 --json
fact() {  # fact KEY DEFAULT: a number from the warm doctor's engine facts
  "$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["engine"][sys.argv[2]]))' "$STEPS/doctor.json" "$1" \
    2>/dev/null || echo "$2"
}
warm=$(fact start_s 120)  # a fresh process's vLLM start from the compile cache, in seconds
runs=$("$PY" -c 'from engine.bench.runs import FIELD_RUNS, RUNS; print(len([r for r in RUNS if r not in FIELD_RUNS]))')
# Each bench run is a fresh process: a warm start plus its work (a minute is ample at this size), twice over.
bench_s=$(( 2 * runs * (warm + 60) ))
bench_why="2 x $runs runs x (warm start ${warm}s + 60s)"
if [ "$bench_s" -gt "$BENCH_S" ]; then bench_s=$BENCH_S; bench_why="$bench_why, at most BENCH_S"; fi
limit bench_nested "$bench_s" "$bench_why"
step bench_nested "$bench_s" "$PY" -m engine.cli.main bench --shape nested --model "$MODEL" --dtype float32 $invariant --json
if [ "${gpus:-0}" -ge 2 ]; then
  limit tensor_parallel "$TP_S" "TP_S: another compiled shape, a cold start again"
  step tensor_parallel "$TP_S" "$PY" -m engine.cli.main doctor --model "$MODEL" --tensor-parallel-size 2 --json
fi
batch=$(fact max_num_seqs 1024)
limit scheduler 60 "no vLLM"
step scheduler 60 "$PY" -m engine.cli.main bench --scheduler-only --rows-in-flight "1024,$batch" --json
trap - EXIT
report
