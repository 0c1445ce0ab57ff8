#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/persistent_raster.sh   (JOBS: compiles)
# Raster groups of the persistent leads (session 14): under ncu our persistent 128 x 256 read 2.3x cuBLAS's DRAM bytes
# on 6278_12800_1600 nk (groups of 8 tile-rows walk all 50 tile-columns, so B's panels are read about six times), and
# both ran power-bound at 1.57-1.59 GHz. The rules' first setting on large compute-bound problems with raster groups
# of 4, 16, 32 and 64 tile-rows beside its 8.
SHAPES="6278_12800_1600:nk,4437_8192_8192:nk,4981_4096_11008:nk,7471_4096_4096:nk,4772_1600_6400:nk"
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 1 --shapes "$SHAPES" --update '{"raster_group": 4}' \
  --update '{"raster_group": 16}' --update '{"raster_group": 32}' --update '{"raster_group": 64}' \
  --json "$OUT/sweep_persistent_raster.json"
