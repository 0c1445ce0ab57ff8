#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/persistent_pairs.sh   (JOBS: compiles)
# Persistent multicast pairs (session 14) on problems of many waves: the rules' first three settings (their
# persistent leads, beyond a wave) each also in a multicast pair (--update cluster_m 2, where block_n allows it), and
# the 128 x 256 pair one tile a CTA. Large compute-bound shapes of the 48-shape suite (cuBLAS runs 2-CTA clusters,
# persistent, there), M just under 256 with a large N (a 256-row tile reads A 256 rows a k-tile for 128 columns; a
# pair of 128 x 256 tiles reads 128 + 128 rows a CTA), mid shapes of the dev suite.
SHAPES="4437_8192_8192:nk,7471_4096_4096:nk,4981_4096_11008:nk,6278_12800_1600:nk,4772_1600_6400:nk"
SHAPES="$SHAPES,4096_4096_4096:both,252_151936_896:nk,252_128256_8192:nk,222_32000_4096:nk,205_50304_1024:nk"
SHAPES="$SHAPES,3072_8192_1024:nk,1024_4096_4096:nk"
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 3 --update '{"cluster_m": 2}' \
  --params '{"block_m": 128, "block_n": 256, "stages": 4, "cluster_m": 2}' \
  --shapes "$SHAPES" --json "$OUT/sweep_persistent_pairs.json"
