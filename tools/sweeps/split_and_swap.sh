#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/split_and_swap.sh   (JOBS: compiles)
# 1. Few C tiles and a long K (512_1024_8192: search's best 0.89-0.94x of cuBLAS, session 10): tilings of ~128 CTAs
#    the rules never propose there (cluster pairs in K groups, split 2 of smaller tiles), and the class boundary
#    (768_1024_6144: 48 tiles of 128 x 128, no split proposed).
# 2. What a swapped tile costs at equal work: 1024_4096_4096, 128 tiles either way (128 x 256 unswapped against
#    256 x 128 swapped, both m64n256 wgmmas per consumer), and 657_9984_3144 (swapped 224-row tiles pad M 2%, the
#    listed 128-row ones 17%, yet measured 0.88 against 0.93x of cuBLAS).
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
c2='"consumers": 2, "stages": 4'
$S --top 2 --shapes 512_1024_8192:both,512_768_4096:both,256_2048_8192:both,768_1024_6144:both \
  --json "$OUT/sweep_split.json" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c2, \"split_k\": 2, \"k_groups\": 2}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2, \"split_k\": 2, \"k_groups\": 4}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2, \"split_k\": 4}" \
  --params "{\"block_m\": 128, \"block_n\": 192, $c2, \"split_k\": 2, \"k_groups\": 2}" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c2, \"split_k\": 2}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c2, \"split_k\": 4}" \
  --params '{"block_m": 64, "block_n": 128, "consumers": 1, "stages": 6, "split_k": 2}' \
  --params "{\"block_m\": 128, \"block_n\": 64, $c2, \"split_k\": 2}" \
  --params '{"block_m": 64, "block_n": 64, "consumers": 1, "stages": 6, "split_k": 2}'
$S --top 0 --shapes 1024_4096_4096:both,657_9984_3144:both --json "$OUT/sweep_swapcost.json" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c2, \"swap_ab\": true}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c2}" \
  --params '{"block_m": 128, "block_n": 256, "consumers": 2, "stages": 3, "persistent": true, "epilogue": "tma"}' \
  --params '{"block_m": 256, "block_n": 128, "consumers": 2, "stages": 3, "persistent": true, "swap_ab": true}' \
  --params "{\"block_m\": 224, \"block_n\": 128, $c2, \"swap_ab\": true}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2, \"epilogue\": \"direct\"}"
