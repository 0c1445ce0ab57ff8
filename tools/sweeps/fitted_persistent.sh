#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/fitted_persistent.sh   (JOBS: compiles)
# Fitted nk widths (block_n a multiple of 16, not 64) beyond one wave: the rules try them only non-persistent, since
# the TMA-store epilogue of the persistent lead needs 64-column panels. Persistent blocks with the smem epilogue
# still overlap a tile's loads with the last one's stores. 3072_2304_768 nk sits at 0.89x of cuBLAS (K = 768: 12
# k-tiles a tile, so a tile's fixed costs weigh) with 128 x 224 (264 tiles: two whole waves).
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
p='"consumers": 2, "persistent": true, "block_m": 128'
$S --top 3 --shapes 3072_2304_768:nk,7214_896_896:nk,3072_4800_1600:nk,4732_896_896:nk,6278_12800_1600:nk \
  --json "$OUT/sweep_fitted_persistent.json" \
  --params "{$p, \"block_n\": 224, \"stages\": 3}" --params "{$p, \"block_n\": 160, \"stages\": 4}" \
  --params "{$p, \"block_n\": 160, \"stages\": 5}" --params "{$p, \"block_n\": 96, \"stages\": 6}" \
  --params "{$p, \"block_n\": 224, \"stages\": 3, \"raster_group\": 16}"
