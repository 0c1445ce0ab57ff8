#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/whole_space.sh   (JOBS: compiles)
# Every setting space() lists (it lists at most 30; a default run measures 16 of them) on the 48-shape suite's
# problems whose search's best stayed under cuBLAS in session 13, both layouts, and sm80_mma's first eight on the
# small ones: is the loss the order's (a better setting past the 16th) or the family's (none in the list)?
SHAPES="7214_896_896,4437_512_3584,512_1024_8192,414_2472_11744,657_9984_3144,4772_1600_6400,310_40_928"
SHAPES="$SHAPES,534_32_1120,3072_2304_768,205_50304_1024,252_151936_896,1246_3072_8192,222_32000_4096"
SHAPES="$SHAPES,251_32000_4096"
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 30 --b-layout both --shapes "$SHAPES" --budget-s "${BUDGET_S:-420}" \
  --json "$OUT/sweep_whole_space.json"
python3 tools/sweep.py --family sm80_mma --jobs "${JOBS:-16}" --top 8 --b-layout both \
  --shapes 7214_896_896,4437_512_3584,310_40_928,534_32_1120 --json "$OUT/sweep_whole_space_sm80.json"
