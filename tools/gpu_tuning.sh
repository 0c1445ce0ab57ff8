#!/usr/bin/env bash
# One device call (about 8 minutes, at most 9.6): whole parameter spaces of 11 shape-layouts measured into a tuning database
# ($OUT/tuning.sqlite), then the leave-one-shape-out table of tools/compare_search.py (learned order vs today's vs
# random). Shapes: tools/gen_shapes.py --seed 101 --count 8 (not the 48-shape suite, seed 2026), the first four in
# kn, the last four in nk, and one shape of each class the issue found losing (few tiles with a long K, a one-wave odd
# size, large M and K with N in the hundreds).
# Usage on the GPU machine: bash tools/gpu_tuning.sh   (logs and the database land in $OUT)
. tools/gpu_env.sh
export HGEMM_AGENT_CACHE=$PWD/.cache/cubins
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=.cache/tuning_shapes; mkdir -p "$S"
python3 tools/gen_shapes.py --seed 101 --count 8 > "$S/suite.txt"
{ grep -v '^#' "$S/suite.txt" | head -4; echo 1000_1000_1000; } > "$S/kn.txt"
{ grep -v '^#' "$S/suite.txt" | tail -4; echo 1024_128_4096; echo 6144_384_3584; } > "$S/nk.txt"
T0=$(date +%s)
timeout 100 python3 tools/prebuild.py "$S/kn.txt" --b-layout kn --jobs 16 --cache "$HGEMM_AGENT_CACHE" > "$OUT/prebuild.log" 2>&1
timeout 50 python3 tools/prebuild.py "$S/nk.txt" --b-layout nk --jobs 16 --cache "$HGEMM_AGENT_CACHE" >> "$OUT/prebuild.log" 2>&1
echo "prebuild $(( $(date +%s) - T0 )) s: $(grep -c sources "$OUT/prebuild.log") of 2 lists done"
for L in kn nk; do
  B=$([ $L = kn ] && echo 2.0 || echo 2.4)
  timeout $([ $L = kn ] && echo 150 || echo 175) python3 -m agent run --shapes "$S/$L.txt" --b-layout $L \
    --max-candidates 200 --budget-minutes $B --no-profile --db "$OUT/tuning.sqlite" > "$OUT/sweep_$L.log" 2>&1
  echo "sweep $L rc=$? at $(( $(date +%s) - T0 )) s"
done
python3 -m agent db --db "$OUT/tuning.sqlite" 2>&1 | tail -8
echo "--- the rules' order as a weaker prior (--rank-weight 0.003; the default is 0.02):"
timeout 35 python3 tools/compare_search.py --db "$OUT/tuning.sqlite" --seeds 10 --min-space 20 --rank-weight 0.003 \
  > "$OUT/compare_rw003.txt" 2>&1; tail -3 "$OUT/compare_rw003.txt"
timeout 50 python3 tools/compare_search.py --db "$OUT/tuning.sqlite" --seeds 10 --min-space 20 2>&1 | tee "$OUT/compare.txt"
