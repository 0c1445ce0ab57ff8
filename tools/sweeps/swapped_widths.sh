#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/swapped_widths.sh   (JOBS: compiles)
# Swapped tiles of M's rows beyond a wave, persistent, at the row counts that fill whole waves, in both layouts: on
# 3072_2304_768 144 x 128 (22 x 18 tiles: 3 waves) measured 1.12x kn and 0.98x nk where _cost ranks 224 x 128 (1.9
# waves: 1.08x, 0.94x) ahead of it, and nk's listed best is 0.89x (session 10). Which row counts win, and where?
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
w='"swap_ab": true, "epilogue": "smem", "persistent": true, "consumers": 2, "block_n": 128'
$S --top 2 --shapes 3072_2304_768:both,3072_4800_1600:both,4981_4096_11008:nk,256_2304_768:nk,183_4096_1024:nk \
  --json "$OUT/sweep_swapped_widths.json" \
  --params "{\"block_m\": 144, $w, \"stages\": 5}" --params "{\"block_m\": 176, $w, \"stages\": 4}" \
  --params "{\"block_m\": 208, $w, \"stages\": 4}" --params "{\"block_m\": 224, $w, \"stages\": 3}"
