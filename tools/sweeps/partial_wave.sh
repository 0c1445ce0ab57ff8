#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/partial_wave.sh   (JOBS: compile processes)
# partial-wave long-K problems (C tiles fill under a wave, K >= 64 k-tiles): K groups and cluster pairs
S="python3 tools/sweep.py --top 4 --jobs ${JOBS:-16} ${EXTRA}"
c='"consumers": 2, "stages": 4'
$S --shapes 414_2472_11744:kn --json $OUT/sweep_part1.json \
  --params "{\"block_m\": 192, \"block_n\": 128, \"consumers\": 3, \"stages\": 4, \"split_k\": 2}" \
  --params "{\"block_m\": 128, \"block_n\": 192, $c, \"split_k\": 2}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c, \"split_k\": 2}" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c, \"k_groups\": 1, \"split_k\": 2}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c, \"split_k\": 2}"
$S --shapes 512_1024_8192:kn --json $OUT/sweep_part2.json \
  --params "{\"block_m\": 128, \"block_n\": 128, $c, \"split_k\": 4}" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c, \"k_groups\": 4}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c, \"split_k\": 8}" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c, \"split_k\": 2, \"k_groups\": 2}"
