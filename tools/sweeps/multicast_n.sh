#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/multicast_n.sh   (JOBS: compiles)
# Multicast along N (session 14: clusters of 2 or 4 CTAs on adjacent column tiles, each loading a share of A's rows).
# cuBLAS's kernel for 414_2472_11744 nk under ncu (tools/ncu_compare.py) is nvjet 64x144 in clusters of 4 sharing
# the 144 rows of M: 120 CTAs, 39 µs against our 208 x 128 in 3 K groups' 46 µs. Part 1: that structure in our
# family beside the rules' best; part 2: the rules' first four settings with cluster_n 2 and 4 on problems with few
# tiles of rows and many of columns (A's tile large against B's), and on large ones. 512_1024_8192 (0.94-0.96x):
# its tiles split in K groups, in clusters along N.
S414="414_2472_11744:both,512_1024_8192:both"
SW='"swap_ab": true, "epilogue": "smem"'
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 2 --shapes "$S414" \
  --params "{\"block_m\": 144, \"block_n\": 64, \"consumers\": 1, \"stages\": 8, $SW}" \
  --params "{\"block_m\": 144, \"block_n\": 128, \"consumers\": 2, \"stages\": 6, \"k_groups\": 2, $SW}" \
  --params "{\"block_m\": 208, \"block_n\": 64, \"consumers\": 1, \"stages\": 6, $SW}" \
  --params '{"block_m": 128, "block_n": 64, "consumers": 2, "stages": 8, "k_groups": 2}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6, "k_groups": 4}' \
  --update '{"cluster_n": 2}' --update '{"cluster_n": 4}' --json "$OUT/sweep_multicast_n_414.json"
SHAPES="657_9984_3144:nk,205_50304_1024:nk,222_32000_4096:nk,252_151936_896:nk"
SHAPES="$SHAPES,6278_12800_1600:nk,231_3072_24576:nk,256_2048_16384:nk,1607_392_11704:nk,3072_2304_768:nk"
SHAPES="$SHAPES,7214_896_896:nk,1246_3072_8192:nk"
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 4 --shapes "$SHAPES" --update '{"cluster_n": 2}' \
  --update '{"cluster_n": 4}' --budget-s "${BUDGET_S:-240}" --json "$OUT/sweep_multicast_n.json"
