#!/usr/bin/env bash
# One check of a GPU node with vLLM's CUDA build (make install EXTRAS=gpu,dev), under 8 minutes:
#   1. batchllm doctor              platform, vLLM, GPUs, a real start, 16 answers
#   2. bench --shape nested         fp32, batch-invariant on GPUs: ratios, and answers equal across runs
#   3. a tensor-parallel start      doctor with --tensor-parallel-size 2, when 2 GPUs are present
#   4. bench --scheduler-only       our cost per step at this node's batch size (doctor's max_num_seqs)
# Each step has its own time limit; one that fails is recorded (exit code, stderr tail) and the
# next runs. Writes one JSON file: benchmarks/gpu_check.sh [OUT.json] (default gpu_check.json).
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

"$PY" -m engine.cli prepare-model "$MODEL" >/dev/null 2>&1 || true  # a built-in is prepared once (no-op for a path)
gpus=$("$PY" -c 'from engine.gpus import gpus; print(len(gpus()))' 2>/dev/null || echo 0)
# vLLM's batch-invariant mode is Triton kernels, GPUs only; on a CPU (a dry run of this script) fp32
# answers do not depend on the batch anyway.
invariant=$([ "${gpus:-0}" -ge 1 ] && echo --batch-invariant)
step doctor 150 "$PY" -m engine.cli doctor --model "$MODEL" --json
step bench_nested 210 "$PY" -m engine.cli bench --shape nested --model "$MODEL" --dtype float32 $invariant --json
if [ "${gpus:-0}" -ge 2 ]; then
  step tensor_parallel 90 "$PY" -m engine.cli doctor --model "$MODEL" --tensor-parallel-size 2 --json
fi
batch=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["engine"]["max_num_seqs"])' "$WORK/doctor.json" 2>/dev/null || echo 1024)
step scheduler 60 "$PY" -m engine.cli bench --scheduler-only --rows-in-flight "1024,$batch" --json

"$PY" - "$WORK" "$OUT" "$started" "$gpus" "$batch" <<'EOF'
import json, pathlib, sys, time

work, out, started, gpus, batch = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
report = {"seconds": int(time.time()) - started, "gpus": int(gpus or 0), "batch_size_checked": int(batch), "steps": {}}
for rc in sorted(work.glob("*.rc")):
    name = rc.stem
    text = (work / f"{name}.json").read_text()
    try:
        result = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        result = {"unparsed_stdout": text[-2000:]}
    report["steps"][name] = {"exit_code": int(rc.read_text()), "result": result,
                             "stderr_tail": (work / f"{name}.err").read_text()[-3000:]}
report["ok"] = all(step["exit_code"] == 0 for step in report["steps"].values())
pathlib.Path(out).write_text(json.dumps(report, indent=2))
print(f"gpu_check: {'all steps passed' if report['ok'] else 'a step failed'} in {report['seconds']}s -> {out}", file=sys.stderr)
sys.exit(0 if report["ok"] else 1)
EOF
