#!/usr/bin/env bash
# One GPU session: warm Triton's cache in parallel, run the GPU tests, run the decode benchmark
# (every backend side by side, the previous launch target as a variant, per-stage timelines).
# Logs and results go to a new folder under $RUN (default /tmp/monodecode-run); at the end
# everything is packed into $OUT/run.tgz and the main log + JSON are copied to $OUT (the device
# tool returns at most 8 files).
# Usage (repository root, GPU machine): benchmarks/device_run.sh [all | PHASE[,PHASE...]]
#   phases: tests (Triton GPU tests, the step launch's included), bench (decode benchmark), gpu_all
#   (every GPU-marked test in the tree but tests/vllm), experiments (experiments.py)
# BUDGET_S (default 540) bounds the whole run: each phase gets at most what is left of it.
# BENCH_ARGS: extra decode_latency.py arguments (e.g. --profiles llama3-1b --batches 1,8 --contexts 1024);
#   the prewarm (compiles the compiled stock steps in parallel first) takes the same arguments.
# STEP_TESTS_TIMEOUT (default 240) bounds the step launch's tests (after the Triton ones).
# PREWARM_TIMEOUT (default 150), BENCH_TIMEOUT (default 420), BENCH_RESERVE_S (default 75) bound the bench.
# STACK_S (default 90): a GPU test running longer has its stack printed into the summary.
# TIMELINE_BATCHES: batches drawn as per-stage timelines (default 1,8; set but empty: none).
set -uo pipefail
# every bound in seconds a whole number, checked before anything is written
for v in BUDGET_S STACK_S WARM_TIMEOUT TESTS_TIMEOUT STEP_TESTS_TIMEOUT PREWARM_TIMEOUT BENCH_TIMEOUT BENCH_RESERVE_S \
  GPU_ALL_TIMEOUT EXP_TIMEOUT; do
  if [ -n "${!v+set}" ] && ! [[ "${!v}" =~ ^[0-9]+$ ]]; then
    echo "device_run.sh: $v must be a whole number of seconds, got '${!v}'" >&2
    exit 2
  fi
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results/run}"
# one folder per run: a warm machine keeps the last run's files, and each pack must hold one run
RUN="${RUN:-/tmp/monodecode-run}/$(date -u +%Y%m%dT%H%M%S)"
mkdir -p "$OUT" "$RUN"
what="${1:-all}"
BUDGET_S="${BUDGET_S:-540}"
# a GPU test running past STACK_S (default 90) has its stack printed (pytest's faulthandler_timeout)
STACK_S="${STACK_S:-90}"
left() {  # seconds for the next phase: its cap, or what is left of the budget (at least 5)
  local cap=$1 rest=$((BUDGET_S - SECONDS))
  [ "$rest" -lt 5 ] && rest=5
  [ "$cap" -lt "$rest" ] && echo "$cap" || echo "$rest"
}
want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
pack() {
  tar czf "$OUT/run.tgz" -C "$RUN" . 2>/dev/null
  cp "$RUN"/summary.log "$OUT"/ 2>/dev/null
  cp "$RUN"/decode_latency_*.json "$OUT"/ 2>/dev/null
  true
}
trap pack EXIT
python3 - <<'PY' | tee "$RUN/device.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.get_device_name()} sm={p.multi_processor_count} cc={p.major}{p.minor} torch={torch.__version__} triton={triton.__version__}")
PY
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$RUN/device.txt"
SM=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
CAP=$(python3 -c 'import torch; p=torch.cuda.get_device_properties(0); print(p.major*10+p.minor)')
EXP=""
want experiments && EXP="--experiments"
if want bench || want experiments; then  # the benchmark's builds, its default variants included
  WARM=()
  while read -r v; do WARM+=(--target "$v"); done < <(PYTHONPATH="$PWD/ops:$PYTHONPATH" python3 -c \
    'import json; from monodecode_ops.decode_bench.harness import DEFAULT_VARIANTS as V; [print(json.dumps(v)) for v in V.values()]')
else  # tests only
  WARM=(--tests-only)
fi
timeout "$(left "${WARM_TIMEOUT:-150}")" python3 benchmarks/warm_cache.py --sm "$SM" --cc "$CAP" $EXP \
  "${WARM[@]}" ${WARM_ARGS:-} > "$RUN/warm_cache.log" 2>&1
echo "[${SECONDS}s] warm cache rc=$? $(tail -1 "$RUN/warm_cache.log")" | tee -a "$RUN/summary.log"
if want tests; then
  timeout "$(left "${TESTS_TIMEOUT:-150}")" python3 -m pytest tests/kernels/triton/test_triton_numerics.py \
    tests/kernels/triton/test_triton_vllm_graph.py -q -p no:cacheprovider -rA -o faulthandler_timeout="$STACK_S" \
    > "$RUN/numerics.log" 2>&1
  echo "[${SECONDS}s] triton GPU tests rc=$?" | tee -a "$RUN/summary.log"
  grep -E "passed|failed|error" "$RUN/numerics.log" | tail -3 | tee -a "$RUN/summary.log"
  grep -E "^(FAILED|ERROR)" "$RUN/numerics.log" | head -20 | tee -a "$RUN/summary.log"
  # a test past STACK_S printed every thread's stack: the test and the line a hung launch waits in
  grep -A12 -E "^Timeout \(" "$RUN/numerics.log" | head -40 | tee -a "$RUN/summary.log"
  # the step launch's GPU tests (Gluon, sm_90+; skipped elsewhere), in a run of their own so that
  # their compiles cannot cut the tests above short (STEP_TESTS_TIMEOUT, default 240)
  timeout "$(left "${STEP_TESTS_TIMEOUT:-240}")" python3 -m pytest tests/kernels/triton/test_step_gpu.py \
    -q -p no:cacheprovider -rA -o faulthandler_timeout="$STACK_S" > "$RUN/step_tests.log" 2>&1
  echo "[${SECONDS}s] step launch GPU tests rc=$?" | tee -a "$RUN/summary.log"
  grep -A12 -E "^Timeout \(" "$RUN/step_tests.log" | head -40 | tee -a "$RUN/summary.log"
  grep -E "passed|failed|error|skipped" "$RUN/step_tests.log" | tail -3 | tee -a "$RUN/summary.log"
  grep -E "^(FAILED|ERROR)" "$RUN/step_tests.log" | head -20 | tee -a "$RUN/summary.log"
fi
if want bench; then
  # the compiled stock steps' graphs, compiled in parallel into inductor's and Triton's caches
  # (tuning results discarded: the benchmark tunes on an idle GPU); a cut-short warm-up only
  # leaves more to compile in the benchmark (timeout signals the workers' process group too)
  timeout "$(left "${PREWARM_TIMEOUT:-150}")" python3 benchmarks/decode_latency.py --prewarm-only ${BENCH_ARGS:-} \
    > "$RUN/prewarm.log" 2>&1
  echo "[${SECONDS}s] prewarm rc=$? $(tail -1 "$RUN/prewarm.log")" | tee -a "$RUN/summary.log"
  # the harness stops starting cells BENCH_RESERVE_S (default 75) before the phase's limit, so its
  # tables and plots are written; cells it did not start are recorded as skipped
  bench_s=$(left "${BENCH_TIMEOUT:-420}")
  timeout "$bench_s" python3 benchmarks/decode_latency.py --out "$RUN" \
    --timeline-batches "${TIMELINE_BATCHES-1,8}" --deadline-s $((bench_s > ${BENCH_RESERVE_S:-75} + 10 ? bench_s - ${BENCH_RESERVE_S:-75} : 10)) \
    ${BENCH_ARGS:-} > "$RUN/bench.log" 2>&1
  echo "[${SECONDS}s] bench rc=$?" | tee -a "$RUN/summary.log"
  # everything but the long per-backend table (kept in bench.log and the JSON)
  grep -vE "^\| [a-z0-9-]+ \| (bf16|fp8) \| [0-9]+ \| [0-9]+ \| [a-z0-9-]+ \| " "$RUN/bench.log" | tail -150 | tee -a "$RUN/summary.log"
fi
if want gpu_all; then
  # ops/ on the path for monodecode_ops; modules whose test-only packages the GPU image lacks
  # (jsonschema, pydantic) fail collection but hold no GPU test
  PYTHONPATH="$PWD/ops:$PYTHONPATH" timeout -s INT "$(left "${GPU_ALL_TIMEOUT:-240}")" python3 -m pytest -m gpu tests \
    --ignore=tests/vllm --continue-on-collection-errors -v -p no:cacheprovider -rA > "$RUN/gpu_all_tests.log" 2>&1
  echo "[${SECONDS}s] every GPU-marked test rc=$?" | tee -a "$RUN/summary.log"
  grep -E "^(FAILED|ERROR)|passed|failed" "$RUN/gpu_all_tests.log" | tail -25 | tee -a "$RUN/summary.log"
fi
if want experiments; then
  timeout "$(left "${EXP_TIMEOUT:-120}")" python3 benchmarks/experiments.py > "$RUN/experiments.log" 2>&1
  echo "[${SECONDS}s] experiments rc=$?" | tee -a "$RUN/summary.log"; cat "$RUN/experiments.log" | tee -a "$RUN/summary.log"
fi
