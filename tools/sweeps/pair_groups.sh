#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/pair_groups.sh   (JOBS: compiles)
# Multicast pairs in K groups (session 13) on few-tile long-K problems, beside the rules' first eight: every pair
# `splits.pair_group_settings` finds with the search order's limits loosened (each CTA at least 16 k-tiles, any fill
# of the SMs, any M), each also unpaired (--update cluster_m 1) to tell the multicast from the K split. Session 13's
# sweep measured six of each problem's pairs (the least work a CTA first; BENCHMARKS.md), all among these. Two
# problems of the 48-shape suite, the rest from seeds it never tuned on (gen_shapes.py --seed 3, 4, 5, 6, 9, 12, 14,
# 16, 101) and the issue's 1024_128_4096.
SHAPES="512_1024_8192:both,414_2472_11744:both,914_1152_10400:nk,579_1000_14960:nk,1024_256_2048:nk,221_1024_8192:nk"
SHAPES="$SHAPES,256_2048_16384:nk,1607_392_11704:nk,231_3072_24576:nk,1372_192_6168:nk,128_4096_4096:nk"
SHAPES="$SHAPES,2048_256_2048:nk,1024_128_4096:nk,512_3072_24576:nk,463_1312_2000:nk"
python3 - "$SHAPES" "$OUT/pair_groups_settings.json" <<'PY'
import json, sys
from core.device import H200
from core.records import Problem
from templates.sm90_wgmma.costs import MIN_K_TILES, TILES
from templates.sm90_wgmma.search import _swapped_shapes
from templates.sm90_wgmma.splits import pair_group_settings
out = {}
for item in sys.argv[1].split(","):
    mnk, _, layout = item.partition(":")
    for lay in ("kn", "nk") if layout == "both" else (layout,):
        p = Problem(*map(int, mnk.split("_")), lay)
        shapes = [{"block_m": bm, "block_n": bn, "consumers": c} for bm, bn, c in TILES] + _swapped_shapes(p)
        pairs = pair_group_settings(p, H200.sms, H200.smem_per_sm, shapes, min_k_tiles=MIN_K_TILES, fill=0, min_m=0)
        out[f"{mnk}:{lay}"] = [v.model_dump() for v in pairs]
json.dump(out, open(sys.argv[2], "w"))
PY
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 8 --settings "$OUT/pair_groups_settings.json" \
  --update '{"cluster_m": 1}' --shapes "$SHAPES" --json "$OUT/sweep_pair_groups.json"
