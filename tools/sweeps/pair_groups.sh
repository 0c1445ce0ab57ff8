#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/pair_groups.sh   (JOBS: compiles)
# Multicast pairs in K groups (session 13) on few-tile long-K problems, beside the rules' first eight: for each
# problem up to six pairs (the listed tiles and the swapped tiles of M's rows with 128-column multiples and two or
# more row tiles, as many K groups as one wave holds, each CTA at least 16 k-tiles; the smallest work a CTA first),
# each also unpaired (--update cluster_m 1) to tell the multicast from the K split. The settings are written before
# the sweep, from the family's own parameter model. Two problems of the 48-shape suite, the rest from seeds it never
# tuned on (gen_shapes.py --seed 3, 4, 5, 6, 9, 12, 14, 16, 101) and the issue's 1024_128_4096.
SHAPES="512_1024_8192:both,414_2472_11744:both,914_1152_10400:nk,579_1000_14960:nk,1024_256_2048:nk,221_1024_8192:nk"
SHAPES="$SHAPES,256_2048_16384:nk,1607_392_11704:nk,231_3072_24576:nk,1372_192_6168:nk,128_4096_4096:nk"
SHAPES="$SHAPES,2048_256_2048:nk,1024_128_4096:nk,512_3072_24576:nk,463_1312_2000:nk"
python3 - "$SHAPES" "$OUT/pair_groups_settings.json" <<'PY'
import json, sys
from core.records import Problem
from templates.sm90_wgmma.costs import TILES
from templates.sm90_wgmma.params import deepest
from templates.sm90_wgmma.search import _swapped_shapes
out = {}
for item in sys.argv[1].split(","):
    mnk, _, layout = item.partition(":")
    for lay in ("kn", "nk") if layout == "both" else (layout,):
        p = Problem(*map(int, mnk.split("_")), lay)
        fields = [{"block_m": bm, "block_n": bn, "consumers": c} for bm, bn, c in TILES] + _swapped_shapes(p)
        ranked = []
        for f in fields:
            bm, bn = f["block_m"], f["block_n"]
            tiles = -(-p.m // (2 * bm)) * 2 * -(-p.n // bn)
            groups = min(8, 132 // tiles, -(-p.k // 64) // 16)
            if bn % 128 or -(-p.m // bm) < 2 or bn > -(-p.n // 64) * 64 or tiles >= 66 or groups < 2:
                continue
            if (v := deepest({**f, "cluster_m": 2, "k_groups": groups})) is not None:
                ranked.append((bm * bn / groups * (1 + 40 / bm + 20 / bn) * tiles * bm * bn / (p.m * p.n), v))
        out[f"{mnk}:{lay}"] = [v.model_dump() for _, v in sorted(ranked, key=lambda r: r[0])[:6]]
json.dump(out, open(sys.argv[2], "w"))
PY
python3 tools/sweep.py --jobs "${JOBS:-16}" --top 8 --settings "$OUT/pair_groups_settings.json" \
  --update '{"cluster_m": 1}' --shapes "$SHAPES" --json "$OUT/sweep_pair_groups.json"
