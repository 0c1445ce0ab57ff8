#!/usr/bin/env bash
# One device call: a search over the whole dev suite, then `bench` on it (logs and the run store land in $OUT).
# Usage on the GPU machine: [LAYOUT=nk] bash tools/gpu_devsuite.sh SHAPES_FILE BUDGET_MINUTES MAX_CANDIDATES
. tools/gpu_env.sh
export HGEMM_AGENT_CACHE=$PWD/.cache/cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 420 python3 -m agent run --shapes "$1" --budget-minutes "$2" --max-candidates "$3" --no-profile --b-layout "${LAYOUT:-kn}" \
  > "$OUT/devsuite_${LAYOUT:-kn}_run.log" 2>&1
echo "run rc=$?"; R=$(ls -t runs | grep -v gitkeep | head -1)
timeout 150 python3 -m agent bench "$R" > "$OUT/devsuite_${LAYOUT:-kn}_bench.log" 2>&1; echo "bench rc=$?"
cp "runs/$R/run.sqlite" "$OUT/devsuite_${LAYOUT:-kn}.sqlite"; cp "runs/$R/bench/bench.json" "$OUT/devsuite_${LAYOUT:-kn}_bench.json"
cp "runs/$R/bench/bench.png" "$OUT/devsuite_${LAYOUT:-kn}_bench.png" 2>/dev/null
tail -45 "$OUT/devsuite_${LAYOUT:-kn}_bench.log"
