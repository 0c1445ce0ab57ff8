#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/tall_swapped.sh   (JOBS: compiles)
# Tall swapped tiles with TMA stores in 16-row chunks (session 15): cuBLAS runs large problems with persistent
# 256 x 152-160 tiles in a 4-stage ring; ours, 160-192 rows of M by 256 columns (swapped roles), persistent beside
# the ring's 4 (160) or 3 (192) stages, against the rules' first three on large problems of both layouts. Part 2:
# the rules' first four where search.py now proposes them (`_tall_settings`).
SW='"swap_ab": true, "consumers": 2, "epilogue": "tma"'
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 3 \
  --shapes 4437_8192_8192:nk,6278_12800_1600:nk,4981_4096_11008:nk,7471_4096_4096:kn,657_9984_3144:nk,4096_4096_4096:nk,8192_8192_8192:kn \
  --params "{\"block_m\": 160, \"block_n\": 256, $SW, \"stages\": 4, \"persistent\": true}" \
  --params "{\"block_m\": 192, \"block_n\": 256, $SW, \"stages\": 3, \"persistent\": true}" \
  --params "{\"block_m\": 160, \"block_n\": 256, $SW, \"stages\": 4}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $SW, \"stages\": 4, \"persistent\": true}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $SW, \"stages\": 4, \"persistent\": true}" \
  --params "{\"block_m\": 160, \"block_n\": 256, $SW, \"stages\": 4, \"persistent\": true, \"cluster_m\": 2}" \
  --params "{\"block_m\": 160, \"block_n\": 256, $SW, \"stages\": 4, \"persistent\": true, \"raster_group\": 16}" \
  --json "$OUT/sweep_tall_swapped.json"
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 4 \
  --shapes 3072_4800_1600:nk,3072_8192_1024:kn,12288_1024_64:nk,16384_16384_64:kn,4096_6144_4096:nk,4437_8192_8192:kn,7471_4096_4096:nk \
  --json "$OUT/sweep_tall_swapped_rules.json"
