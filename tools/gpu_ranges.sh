#!/usr/bin/env bash
# One device call: Llama-3-8B's projections over M 1-HI as ranges (tools/range_bench.py), searched in buckets, exported,
# and benched at M no bucket was searched at; the per-series lines of `bench` are the table RESULTS.md's "Every batch
# size" keeps. Logs, show, bench.json and the export (tar) land in $OUT.
# Usage on the GPU machine: [HI=256] bash tools/gpu_ranges.sh BUDGET_MINUTES MAX_CANDIDATES
. tools/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HGEMM_AGENT_TUNING_DB=${HGEMM_AGENT_TUNING_DB:-$OUT/tuning.sqlite}
export HGEMM_OPS_BUILD_DIR=${HGEMM_OPS_BUILD_DIR:-/tmp/opbuild}
T0=$(date +%s); D=$(mktemp -d)
python3 tools/range_bench.py --out "$D" --hi "${HI:-256}" > /dev/null
timeout $(( ${1%.*} * 60 + 150 )) python3 -m agent run --shapes "$D/ranges.txt" --no-profile --budget-minutes "$1" \
  --max-candidates "$2" > "$OUT/ranges_run.log" 2>&1
echo "run rc=$? $(( $(date +%s) - T0 )) s"; R=$(ls -t runs | grep -v gitkeep | head -1)
grep -E "still waiting" "$OUT/ranges_run.log" | head -1
COLUMNS=400 python3 -m agent show "$R" > "$OUT/ranges_show.txt" 2>&1
echo "buckets: $(grep -c '^bucket' "$OUT/ranges_show.txt") with a winner, $(grep '^bucket' "$OUT/ranges_show.txt" | grep -c ': kernel') served"
python3 -m agent export "$R" --out "$D/export" --no-check > "$OUT/ranges_export.log" 2>&1
echo "export rc=$? $(( $(date +%s) - T0 )) s"; tar czf "$OUT/ranges_export.tgz" --exclude build -C "$D" export
COLUMNS=200 timeout 600 python3 -m agent bench "$R" --shapes "$D/bench.txt" --out "$D/bench" > "$OUT/ranges_bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s"; cp "$D/bench/bench.json" "$OUT/ranges_bench.json" 2>/dev/null
grep -E "geomean ratio" "$OUT/ranges_bench.log"
sed -n '/per series benched/,$p' "$OUT/ranges_bench.log"
