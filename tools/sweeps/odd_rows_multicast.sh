#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/odd_rows_multicast.sh   (JOBS: compiles)
# Rows of a K-contiguous operand off 128-byte lines cost L2 traffic (tools/sweeps/row_alignment.sh, session 12:
# 657_9984 nk at K = 3144 against 3136, the swapped 224 x 128 tile 85.1 against 63.6 us, the multicast pair of
# 128 x 256 tiles 76.3 against 70.9, cuBLAS 67.2 against 63.0). Multicast pairs read the shared B tile once per
# pair. 1. Swapped tiles of M's rows in multicast pairs (fitted rows, no rows lost to padding) on 657_9984_3144 and
# its aligned twin. 2. Multicast pairs of the listed tiles next to the rules' first settings on other shapes with
# rows off 128-byte lines (K x 2 bytes not a multiple of 128), two of them from a suite seed never tuned on
# (gen_shapes.py --seed 7: 6180_3064_6296, 242_10976_984).
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
sw='"consumers": 2, "stages": 4, "swap_ab": true, "epilogue": "smem"'
$S --top 3 --shapes 657_9984_3144:both,657_9984_3136:nk --json "$OUT/sweep_odd_rows_swapped.json" \
  --params "{\"block_m\": 112, \"block_n\": 256, $sw, \"cluster_m\": 2}" \
  --params "{\"block_m\": 112, \"block_n\": 256, $sw}" \
  --params "{\"block_m\": 176, \"block_n\": 128, $sw, \"stages\": 5, \"cluster_m\": 2}" \
  --params "{\"block_m\": 176, \"block_n\": 256, $sw, \"stages\": 3, \"cluster_m\": 2}" \
  --params "{\"block_m\": 224, \"block_n\": 128, $sw, \"stages\": 5, \"cluster_m\": 2}" \
  --params '{"block_m": 128, "block_n": 256, "consumers": 2, "stages": 4, "cluster_m": 2}'
c2='"consumers": 2, "stages": 4, "cluster_m": 2'
$S --top 5 --shapes 767_2608_1976:nk,1000_3000_2000:both,2952_1432_1272:nk,6180_3064_6296:both,242_10976_984:nk \
  --json "$OUT/sweep_odd_rows_pairs.json" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2}" --params "{\"block_m\": 256, \"block_n\": 128, $c2}" \
  --params "{\"block_m\": 128, \"block_n\": 128, $c2, \"stages\": 6}"
