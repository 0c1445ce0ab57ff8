#!/usr/bin/env bash
# One device call: the sandbox GPU tests, an exhaustive sweep of three shapes (for tools/compare_search.py), and the
# dev suite with B as an nn.Linear weight (nk) plus its bench. Logs and run stores land in $OUT.
. tools/gpu_env.sh
export HGEMM_AGENT_CACHE=$PWD/.cache/cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -m gpu tests/test_sandbox_gpu.py -s > "$OUT/sandbox_tests.log" 2>&1
echo "sandbox tests rc=$?"; grep -aE "passed|failed|CUPTI" "$OUT/sandbox_tests.log"
timeout 240 python3 -m agent run --mnk 512_512_128,256_4096_4096,1000_3000_2000 --max-candidates 200 \
  --budget-minutes 3.5 --no-profile > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
S=$(ls -t runs | grep -v gitkeep | head -1); cp "runs/$S/run.sqlite" "$OUT/sweep.sqlite"; tail -8 "$OUT/sweep.log"
LAYOUT=nk bash tools/gpu_devsuite.sh .cache/shapes/dev.txt 3 8 2>&1 | tail -36
