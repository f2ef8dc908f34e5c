#!/usr/bin/env bash
# One GPU session: warm Triton's cache in parallel, run the GPU numerics tests, run the decode
# benchmark. Everything it prints and writes goes under $OUT (default ./benchmarks/results/run).
# Usage (repository root, GPU machine): benchmarks/device_run.sh [tests|bench|all]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results/run}"
mkdir -p "$OUT"
what="${1:-all}"
python3 - <<'PY' | tee "$OUT/device.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.get_device_name()} sm={p.multi_processor_count} cc={p.major}{p.minor} torch={torch.__version__} triton={triton.__version__}")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$OUT/device.txt"
SM=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
CAP=$(python3 -c 'import torch; p=torch.cuda.get_device_properties(0); print(p.major*10+p.minor)')
timeout "${WARM_TIMEOUT:-150}" python3 benchmarks/warm_cache.py --sm "$SM" --cc "$CAP" > "$OUT/warm_cache.log" 2>&1
echo "warm cache rc=$? $(tail -1 "$OUT/warm_cache.log")"
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest tests/test_triton_numerics.py -q -p no:cacheprovider -rA > "$OUT/numerics.log" 2>&1
  echo "numerics rc=$?"; grep -E "passed|failed|error" "$OUT/numerics.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/numerics.log" | head -20
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout "${BENCH_TIMEOUT:-230}" python3 benchmarks/decode_latency.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -40 "$OUT/bench.log"
fi
