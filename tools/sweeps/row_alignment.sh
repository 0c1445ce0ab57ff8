#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/row_alignment.sh   (JOBS: compiles)
# Rows of a K-contiguous operand off 128-byte lines (K x 2 bytes not a multiple of 128): 657_9984_3144 sits at
# 0.87x of cuBLAS in nk, 0.92x in kn (session 11), with cuBLAS level in both layouts. The same M and N at K = 3136
# and 3200 (rows on 128-byte lines) against K = 3144 (16-byte aligned), and 414_2472 at K = 11744 (64-byte aligned)
# against 11776, ours and cuBLAS in one process: does our time per k-tile jump where cuBLAS's does not, and which
# loaders and tiles pay for it (TMA against cp.async, B rows a tile, a multicast pair)?
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
c2='"consumers": 2, "stages": 4'
$S --top 3 --shapes 657_9984_3136:both,657_9984_3144:both,657_9984_3200:both,414_2472_11744:nk,414_2472_11776:nk \
  --json "$OUT/sweep_row_alignment.json" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c2}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2, \"loader\": \"cp_async\"}" \
  --params "{\"block_m\": 256, \"block_n\": 128, $c2, \"loader\": \"cp_async\"}" \
  --params "{\"block_m\": 128, \"block_n\": 256, $c2, \"cluster_m\": 2}" \
  --params '{"block_m": 128, "block_n": 256, "consumers": 2, "stages": 3, "persistent": true, "epilogue": "tma"}' \
  --params '{"block_m": 256, "block_n": 128, "consumers": 2, "stages": 3, "persistent": true, "epilogue": "tma"}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6}'
