#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/multicast_n_class.sh   (JOBS: compiles)
# Clusters of 4 along N (session 14) on the class where they won in tools/sweeps/multicast_n.sh (414_2472_11744 nk
# 144 x 64 swapped 0.85 -> 0.975x, 1607_392_11704 nk 128 x 64 1.15x unsplit): tiles of 64 columns and at least twice
# as many rows, unsplit, whose clusters of 4 fill one wave (99-120 CTAs: 30 clusters of 4 run at once), K at least 48
# k-tiles. The problems of the dev suite and of gen_shapes.py seeds 2026, 3-7, 9, 12, 14, 16, 101 where such a tile
# exists, both layouts: the rules' first four beside every such tile in clusters of 4 and of 2.
python3 - "$OUT/multicast_n_settings.json" <<'PY'
import json, sys
from core.records import Problem
from templates.sm90_wgmma.costs import TILES
from templates.sm90_wgmma.params import deepest, launched_tiles
from templates.sm90_wgmma.search import _swapped_shapes
SHAPES = ("1024_1024_4096 1024_1536_8960 1024_1600_6400 148_3584_18944 1607_392_11704 182_3584_18944 2863_512_3584 "
          "414_2472_11744 512_3584_18944 6147_24_12888 914_1152_10400").split()
out = {}
for s in SHAPES:
    for lay in ("kn", "nk"):
        p = Problem(*map(int, s.split("_")), lay)
        fields = [dict(block_m=bm, block_n=bn, consumers=c) for bm, bn, c in TILES if bn == 64]
        fields += [f for f in _swapped_shapes(p) if f["block_n"] == 64]
        found = []
        for f in fields:
            for cn in (4, 2):
                v = deepest({**f, "cluster_n": cn})
                if v is not None and f["block_m"] >= 2 * f["block_n"] and 99 <= launched_tiles(v, p) * (4 // cn) <= 120:
                    found.append(v.model_dump())
        out[f"{s}:{lay}"] = found
json.dump(out, open(sys.argv[1], "w"))
print(sum(map(len, out.values())), "settings")
PY
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 4 --settings "$OUT/multicast_n_settings.json" \
  --budget-s "${BUDGET_S:-200}" --json "$OUT/sweep_multicast_n_class.json"
