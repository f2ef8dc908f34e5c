#!/usr/bin/env bash
# One GPU session: warm Triton's cache in parallel, run the GPU numerics tests, run the decode
# benchmark (every backend side by side), then the launch-configuration experiments. Everything
# it prints and writes goes under $OUT (default ./benchmarks/results/run); at most 8 files.
# Usage (repository root, GPU machine): benchmarks/device_run.sh [all | PHASE[,PHASE...]] (tests, bench, experiments)
# BUDGET_S (default 330) bounds the whole run: each phase gets at most what is left of it.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results/run}"
mkdir -p "$OUT"
what="${1:-all}"
BUDGET_S="${BUDGET_S:-330}"
left() {  # seconds for the next phase: its cap, or what is left of the budget (at least 5)
  local cap=$1 rest=$((BUDGET_S - SECONDS))
  [ "$rest" -lt 5 ] && rest=5
  [ "$cap" -lt "$rest" ] && echo "$cap" || echo "$rest"
}
want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
python3 - <<'PY' | tee "$OUT/device.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.get_device_name()} sm={p.multi_processor_count} cc={p.major}{p.minor} torch={torch.__version__} triton={triton.__version__}")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$OUT/device.txt"
SM=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
CAP=$(python3 -c 'import torch; p=torch.cuda.get_device_properties(0); print(p.major*10+p.minor)')
EXP=""
want experiments && EXP="--experiments"
timeout "$(left "${WARM_TIMEOUT:-120}")" python3 benchmarks/warm_cache.py --sm "$SM" --cc "$CAP" $EXP \
  > "$OUT/warm_cache.log" 2>&1
echo "[${SECONDS}s] warm cache rc=$? $(tail -1 "$OUT/warm_cache.log")"
if want tests; then
  timeout "$(left "${TESTS_TIMEOUT:-120}")" python3 -m pytest tests/kernels/triton/test_triton_numerics.py -q -p no:cacheprovider -rA \
    > "$OUT/numerics.log" 2>&1
  echo "[${SECONDS}s] numerics rc=$?"; grep -E "passed|failed|error" "$OUT/numerics.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/numerics.log" | head -20
fi
if want bench; then
  timeout "$(left "${BENCH_TIMEOUT:-180}")" python3 benchmarks/decode_latency.py --out "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "[${SECONDS}s] bench rc=$?"; grep -vE "^\| .* \| (reference-eager|reference-graph|stock-graph|stock-gemm-floor|triton) \|" "$OUT/bench.log" | tail -40
fi
if want experiments; then
  timeout "$(left "${EXP_TIMEOUT:-120}")" python3 benchmarks/experiments.py > "$OUT/experiments.log" 2>&1
  echo "[${SECONDS}s] experiments rc=$?"; cat "$OUT/experiments.log"
fi
