#!/usr/bin/env bash
# One check of a GPU node with vLLM's CUDA build (make install EXTRAS=gpu,dev):
#   1. batchllm doctor, cold        platform, vLLM, GPUs, a real start (compiles, captures graphs), 16 answers
#   2. batchllm doctor, warm        the same start from the compile cache: what every later process pays
#   3. bench --shape nested         fp32, batch-invariant on GPUs: ratios, and answers equal across runs
#   4. a tensor-parallel start      doctor with --tensor-parallel-size 2, when 2 GPUs are visible
#   5. bench --scheduler-only       our cost per step at this node's batch size (doctor's max_num_seqs)
# Each step has its own time limit; one that fails is recorded (exit code, stderr tail) and the next
# runs. The cold doctor gets COLD_S (default 900 s: a first compile of a large model takes minutes);
# the later limits are sized from the warm start doctor measured (each bench run is a fresh process
# that starts vLLM), and the report says which limits applied and why. Writes one JSON file:
# benchmarks/gpu_check.sh [OUT.json] (default gpu_check.json).
# MODEL=smollm2 (default; a built-in, or any local checkpoint) PYTHON=.venv/bin/python (default).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.json}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: stdout to NAME.json, stderr to NAME.err, exit code to NAME.rc
  local name=$1 limit=$2
  shift 2
  echo "gpu_check: $name (at most ${limit}s)" >&2
  timeout "$limit" "$@" >"$WORK/$name.json" 2>"$WORK/$name.err"
  echo $? >"$WORK/$name.rc"
}

"$PY" -m engine.cli.main prepare-model "$MODEL" >/dev/null 2>&1 || true  # a built-in is prepared once (no-op for a path)
# The GPUs this process may use (CUDA_VISIBLE_DEVICES), not the node's.
gpus=$("$PY" -c 'from engine.gpus import visible_gpus; print(len(visible_gpus()))' 2>/dev/null || echo 0)
# vLLM's batch-invariant mode is Triton kernels, GPUs only; on a CPU (a dry run of this script) fp32
# answers do not depend on the batch anyway.
invariant=$([ "${gpus:-0}" -ge 1 ] && echo --batch-invariant)
COLD_S=${COLD_S:-900}
step doctor_cold "$COLD_S" "$PY" -m engine.cli.main doctor --model "$MODEL" --json
step doctor "$COLD_S" "$PY" -m engine.cli.main doctor --model "$MODEL" --json
fact() {  # fact KEY DEFAULT: a number from the warm doctor's engine facts
  "$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["engine"][sys.argv[2]]))' "$WORK/doctor.json" "$1" \
    2>/dev/null || echo "$2"
}
warm=$(fact start_s 120)  # a fresh process's vLLM start from the compile cache, in seconds
runs=$("$PY" -c 'from engine.bench.runs import FIELD_RUNS, RUNS; print(len([r for r in RUNS if r not in FIELD_RUNS]))')
# Each bench run is a fresh process: a warm start plus its work (a minute is ample at this size), twice over.
bench_s=$(( 2 * runs * (warm + 60) ))
tp_s=$COLD_S  # a two-GPU engine is another compiled shape: a cold start again
step bench_nested "$bench_s" "$PY" -m engine.cli.main bench --shape nested --model "$MODEL" --dtype float32 $invariant --json
if [ "${gpus:-0}" -ge 2 ]; then
  step tensor_parallel "$tp_s" "$PY" -m engine.cli.main doctor --model "$MODEL" --tensor-parallel-size 2 --json
fi
batch=$(fact max_num_seqs 1024)
step scheduler 60 "$PY" -m engine.cli.main bench --scheduler-only --rows-in-flight "1024,$batch" --json

LIMITS="{\"doctor_cold\": [$COLD_S, \"COLD_S: a first start compiles\"], \"doctor\": [$COLD_S, \"as cold, in case the cache missed\"], \"bench_nested\": [$bench_s, \"2 x $runs runs x (warm start ${warm}s + 60s)\"], \"tensor_parallel\": [$tp_s, \"another compiled shape: COLD_S\"], \"scheduler\": [60, \"no vLLM\"]}"
"$PY" - "$WORK" "$OUT" "$started" "$gpus" "$batch" "$LIMITS" <<'EOF'
import json, pathlib, sys, time

work, out, started, gpus, batch = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
limits = json.loads(sys.argv[6])
report = {"seconds": int(time.time()) - started, "gpus": int(gpus or 0), "batch_size_checked": int(batch), "steps": {}}
for rc in sorted(work.glob("*.rc")):
    name = rc.stem
    text = (work / f"{name}.json").read_text()
    try:
        result = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        result = {"unparsed_stdout": text[-2000:]}
    limit, why = limits[name]
    report["steps"][name] = {"exit_code": int(rc.read_text()), "result": result, "limit_s": limit,
                             "limit_why": why, "timed_out": int(rc.read_text()) == 124,
                             "stderr_tail": (work / f"{name}.err").read_text()[-3000:]}
report["ok"] = all(step["exit_code"] == 0 for step in report["steps"].values())
pathlib.Path(out).write_text(json.dumps(report, indent=2))
print(f"gpu_check: {'all steps passed' if report['ok'] else 'a step failed'} in {report['seconds']}s -> {out}", file=sys.stderr)
sys.exit(0 if report["ok"] else 1)
EOF
