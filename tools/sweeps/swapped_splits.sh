#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/swapped_splits.sh   (JOBS: compiles)
# Swapped tiles of M's rows (session 9) with K split, for the classes they did not cure alone: under a wave with a
# long K (414_2472_11744: 3 x 20 tiles of 144 x 128 split in 2 fill 120 SMs; 128 x 192 split 2 made 104), the
# split-K leaders' class (512_1024_8192), and M = 64 decode-like shapes with two consumers on the B tile.
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
w='"swap_ab": true, "epilogue": "smem"'
$S --top 1 --shapes 414_2472_11744:both --json "$OUT/sweep_swapped_split1.json" \
  --params "{\"block_m\": 144, \"block_n\": 128, \"consumers\": 2, $w, \"split_k\": 2}" \
  --params "{\"block_m\": 144, \"block_n\": 128, \"consumers\": 2, $w, \"k_groups\": 2}" \
  --params "{\"block_m\": 208, \"block_n\": 128, \"consumers\": 2, $w, \"k_groups\": 3}" \
  --params "{\"block_m\": 144, \"block_n\": 192, \"consumers\": 3, $w, \"split_k\": 2}"
$S --top 1 --shapes 512_1024_8192:kn --json "$OUT/sweep_swapped_split2.json" \
  --params "{\"block_m\": 176, \"block_n\": 128, \"consumers\": 2, $w, \"split_k\": 4}" \
  --params "{\"block_m\": 176, \"block_n\": 128, \"consumers\": 2, $w, \"k_groups\": 4}"
$S --top 2 --shapes 64_16384_4096:kn,128_8192_8192:kn --json "$OUT/sweep_swapped_split3.json" \
  --params "{\"block_m\": 64, \"block_n\": 256, \"consumers\": 2, $w}" \
  --params "{\"block_m\": 64, \"block_n\": 128, \"consumers\": 2, $w}"
