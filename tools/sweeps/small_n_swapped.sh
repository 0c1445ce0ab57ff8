#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/small_n_swapped.sh   (JOBS: compiles)
# Few C tiles because N is tiny (at most 64) and M moderate: the listed tiles' 64 rows give ceil(M / 64) x ceil(N /
# 16) CTAs (534_32_1120: 18), cuBLAS runs 68 CTAs of 8 rows (session 14's ncu). Swapped tiles of 16 or 32 of M's
# rows (N padded to one m64 wgmma) give ceil(M / 16) CTAs, split K in clusters or K groups twice that; against the
# rules' first three.
SW='"swap_ab": true, "consumers": 1, "block_n": 64, "epilogue": "smem"'
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 3 --budget-s "${BUDGET_S:-200}" \
  --shapes 534_32_1120:nk,310_40_928:nk,534_32_1120:kn,310_40_928:kn \
  --params "{\"block_m\": 16, $SW, \"stages\": 12}" \
  --params "{\"block_m\": 32, $SW, \"stages\": 12}" \
  --params "{\"block_m\": 16, $SW, \"stages\": 8, \"split_k\": 2}" \
  --params "{\"block_m\": 16, $SW, \"stages\": 8, \"k_groups\": 2}" \
  --params "{\"block_m\": 32, $SW, \"stages\": 8, \"split_k\": 2}" \
  --params "{\"block_m\": 16, $SW, \"stages\": 12, \"loader\": \"cp_async\"}" \
  --json "$OUT/sweep_small_n_swapped.json"
