#!/usr/bin/env bash
# One device call: GPU tests, two runs (one shape; three dev shapes), export + re-check, bench (offline, server).
# Usage on the GPU machine: bash tools/gpu_validate.sh  (with .whl and .cache carried; logs land in $OUT)
. tools/gpu_env.sh
export HGEMM_AGENT_CACHE=$PWD/.cache/cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log() { echo "=== $*" | tee -a "$OUT/summary.log"; }
log "ncu: $(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 200 python3 -m pytest -q -rs -m gpu tests/test_sandbox_gpu.py tests/adversarial tests/test_profile.py -s \
  > "$OUT/gpu_tests.log" 2>&1; log "gpu tests rc=$?"; grep -aE "passed|failed|FAILED|graph .* CUPTI" "$OUT/gpu_tests.log" | tail -30 | tee -a "$OUT/summary.log"
timeout 150 python3 -m agent run --mnk 1024_1024_1024 --budget-minutes 1.2 --max-candidates 10 > "$OUT/run1.log" 2>&1
log "run1 rc=$?"; tail -12 "$OUT/run1.log" | tee -a "$OUT/summary.log"
timeout 200 python3 -m agent run --mnk 256_1024_256,2048_2048_2048,1000_3000_2000 --b-layout nk --budget-minutes 2 \
  --max-candidates 10 --no-profile > "$OUT/run2.log" 2>&1
log "run2 rc=$?"; tail -12 "$OUT/run2.log" | tee -a "$OUT/summary.log"
R1=$(ls runs | grep -v gitkeep | sort | sed -n 1p); R2=$(ls runs | grep -v gitkeep | sort | sed -n 2p)
for r in $R1 $R2; do timeout 120 python3 -m agent export $r 2>&1 | tee -a "$OUT/summary.log"; done
timeout 120 python3 -m agent bench $R1 $R2 2>&1 | tee -a "$OUT/summary.log" | tail -14
timeout 60 python3 -m agent bench $R2 --mode server --seconds 6 --target-qps 300 2>&1 | tee -a "$OUT/summary.log" | tail -10
cp runs/$R1/run.sqlite "$OUT/run1.sqlite"; cp runs/$R2/run.sqlite "$OUT/run2.sqlite"
cp runs/$R1/bench/bench.json "$OUT/bench.json" 2>/dev/null
