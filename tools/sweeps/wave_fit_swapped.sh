#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/wave_fit_swapped.sh   (JOBS: compiles)
# M-fitted swapped tiles that fill whole waves where the listed ones leave a thin last one: 4772_1600_6400 has 247
# tiles of 256 x 128 (1.9 waves) and 266 of 128 x 256 (2.02); 240 x 128 swapped makes 260 (1.97) with 0.6% of M
# padded, 160 x 128 390 (2.95). tile_cost puts 240 x 128 6% ahead of the lead, under SWAP_FIT_GAIN's 8% bar.
SW='"swap_ab": true, "consumers": 2, "block_n": 128, "epilogue": "tma", "persistent": true'
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 3 --budget-s "${BUDGET_S:-200}" \
  --shapes 4772_1600_6400:both,3072_2304_768:nk \
  --params "{\"block_m\": 240, $SW, \"stages\": 4}" \
  --params "{\"block_m\": 240, $SW, \"stages\": 4, \"cluster_m\": 2}" \
  --params "{\"block_m\": 160, $SW, \"stages\": 6}" \
  --params "{\"block_m\": 240, \"swap_ab\": true, \"consumers\": 2, \"block_n\": 128, \"epilogue\": \"smem\", \"stages\": 4}" \
  --params "{\"block_m\": 112, \"swap_ab\": true, \"consumers\": 2, \"block_n\": 256, \"epilogue\": \"tma\", \"persistent\": true, \"stages\": 4}" \
  --json "$OUT/sweep_wave_fit_swapped.json"
