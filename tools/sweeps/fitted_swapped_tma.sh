#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/fitted_swapped_tma.sh   (JOBS: compiles)
# M-fitted swapped tiles, persistent with TMA stores in 16-row chunks (session 15): with the smem epilogue their C
# tile beside the ring left 2-3 stages (224 x 128: 2), with chunked TMA stores 4-5. cuBLAS's kernels on the losing
# problems are such tiles: 657_9984_3144 nk 224 rows x 128 in pairs, 7214_896_896 nk 200 x 128 in 5 stages, all
# persistent. Against the rules' first three.
SW='"swap_ab": true, "consumers": 2, "epilogue": "tma", "persistent": true'
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 3 --budget-s "${BUDGET_S:-200}" \
  --shapes 657_9984_3144:nk,7214_896_896:nk,4772_1600_6400:both,205_50304_1024:nk,222_32000_4096:nk,3072_2304_768:nk,252_151936_896:nk \
  --params "{\"block_m\": 224, \"block_n\": 128, $SW, \"stages\": 4}" \
  --params "{\"block_m\": 208, \"block_n\": 128, $SW, \"stages\": 5}" \
  --params "{\"block_m\": 112, \"block_n\": 256, $SW, \"stages\": 4}" \
  --params "{\"block_m\": 224, \"block_n\": 128, $SW, \"stages\": 4, \"cluster_m\": 2}" \
  --params "{\"block_m\": 112, \"block_n\": 256, $SW, \"stages\": 4, \"cluster_m\": 2}" \
  --params "{\"block_m\": 160, \"block_n\": 256, $SW, \"stages\": 4}" \
  --params "{\"block_m\": 192, \"block_n\": 256, $SW, \"stages\": 3}" \
  --params "{\"block_m\": 144, \"block_n\": 256, $SW, \"stages\": 4}" \
  --json "$OUT/sweep_fitted_swapped_tma.json"
