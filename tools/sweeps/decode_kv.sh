#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/decode_kv.sh   (JOBS: compile processes)
# decode's k/v projections (N=1024, K=4096): split settings beyond the rules of session 6; gate/up (N=14336) at batch 1, 8
S="python3 tools/sweep.py --top 6 --jobs ${JOBS:-16} ${EXTRA} --kernel-timeout 5"
sw='"consumers": 1, "swap_ab": true, "stages": 8'
for BM in 16 32; do
  [ $BM = 16 ] && SH=1_1024_4096:nk,8_1024_4096:nk || SH=32_1024_4096:nk
  $S --shapes $SH --json $OUT/sweep_kv$BM.json \
    --params "{\"block_m\": $BM, \"block_n\": 64, $sw, \"k_groups\": 8}" \
    --params "{\"block_m\": $BM, \"block_n\": 64, $sw, \"split_k\": 2, \"k_groups\": 4}" \
    --params "{\"block_m\": $BM, \"block_n\": 64, $sw, \"split_k\": 4, \"k_groups\": 2}" \
    --params "{\"block_m\": $BM, \"block_n\": 64, $sw, \"split_k\": 2, \"k_groups\": 8}" \
    --params "{\"block_m\": $BM, \"block_n\": 128, $sw, \"k_groups\": 8}" \
    --params "{\"block_m\": $BM, \"block_n\": 128, $sw, \"split_k\": 2, \"k_groups\": 8}" \
    --params "{\"block_m\": $BM, \"block_n\": 64, $sw, \"k_groups\": 4}"
done
n='"block_m": 64, "consumers": 1, "stages": 8'
$S --shapes 64_1024_4096:nk --json $OUT/sweep_kv64.json \
  --params "{$n, \"block_n\": 64, \"k_groups\": 8}" --params "{$n, \"block_n\": 64, \"split_k\": 2, \"k_groups\": 4}" \
  --params "{$n, \"block_n\": 64, \"k_groups\": 4}" --params "{$n, \"block_n\": 128, \"k_groups\": 8}" \
  --params "{$n, \"block_n\": 64, \"split_k\": 2, \"k_groups\": 8}" --params "{$n, \"block_n\": 64, \"split_k\": 4, \"k_groups\": 2}"
sw='"block_m": 16, "consumers": 1, "swap_ab": true, "stages": 12'
python3 tools/sweep.py --top 10 --jobs ${JOBS:-16} ${EXTRA} --shapes 1_14336_4096:nk,8_14336_4096:nk --json $OUT/sweep_gate.json \
  --params "{$sw, \"block_n\": 128, \"split_k\": 2}" --params "{$sw, \"block_n\": 64, \"k_groups\": 2}"
