#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR [SHAPES=...] [TOP=2] [ROUNDS=2] bash tools/sweeps/prefetch_tensormap.sh
# sm90_wgmma's TMA kernels prefetch their tensor maps (prefetch.tensormap by thread 0, before the barriers are set
# up). This times the rules' first TOP settings of the small and mid-size problems (floor under 12 µs, the 48-shape
# suite's and the dev suite's) with the family's template and with the same template less the prefetches, ROUNDS
# times each in alternation (each sweep next to cuBLAS in its own process), and prints each setting's warm and cold
# ratio with over without (geomean over rounds).
set -e
SHAPES=${SHAPES:-64_64_64:both,142_96_80:both,3204_8_24:both,154_240_448:both,310_40_928:both,512_512_128:both,29_120_2824:both,9_784_560:both,64_4096_64:both,128_2048_128:both,256_1024_256:both,534_32_1120:both,3619_160_208:both,256_2304_768:both,149_768_3072:both,131_400_5632:both,183_4096_1024:both,144_4864_896:both,1024_1024_1024:both,256_128_16384:both,933_6912_16:both,16384_512_128:both,71_3584_3584:both,12288_1024_64:both,16_4096_4096:both,128_4096_4096:both,64_1024_16384:both,4732_896_896:both,512_4800_1600:both,767_2608_1976:both,256_4096_4096:both,512_1024_8192:both,512_8192_1024:both}
BASE=$OUT/kernel_without_prefetch.cu.j2
grep -v "prefetch_tensormap(tm_" templates/sm90_wgmma/kernel.cu.j2 > "$BASE"
set +e
for r in $(seq "${ROUNDS:-2}"); do
  for v in with without; do
    python3 tools/sweep.py --family sm90_wgmma --jobs "${JOBS:-16}" --top "${TOP:-2}" --shapes "$SHAPES" \
      $([ "$v" = without ] && echo --template "$BASE") --json "$OUT/sweep_prefetch_${v}_$r.json" \
      > "$OUT/sweep_prefetch_${v}_$r.log" 2>&1
    echo "round $r $v rc=$?"
  done
done
python3 - "$OUT" "${ROUNDS:-2}" <<'PY'
import json, math, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
def ratios(v):  # (problem, label) -> [(warm, cold, us)] over rounds: t_cuBLAS / t_ours and our warm µs
    got = {}
    for r in range(1, rounds + 1):
        for row in json.loads((out / f"sweep_prefetch_{v}_{r}.json").read_text())["rows"]:
            res = row["result"]
            if res["status"] == "ok":
                got.setdefault((row["problem"], row["label"]), []).append(
                    (res["cublas_warm"]["median_us"] / res["warm"]["median_us"],
                     res["cublas_cold"]["median_us"] / res["cold"]["median_us"], res["warm"]["median_us"]))
    return got
def gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))
w, wo = ratios("with"), ratios("without")
print(f"{'problem':>20} {'#':>3} {'µs':>7} | warm with / without | cold with / without")
bands = {}
for key in sorted(set(w) & set(wo), key=lambda k: statistics.median(x[2] for x in wo[k])):
    a, b = w[key], wo[key]
    gw = gm([x[0] for x in a]) / gm([x[0] for x in b])
    gc = gm([x[1] for x in a]) / gm([x[1] for x in b])
    us = statistics.median(x[2] for x in b)
    band = "under 4 µs" if us < 4 else "4-10 µs" if us < 10 else "over 10 µs"
    bands.setdefault(band, []).append((gw, gc))
    print(f"{key[0]:>20} {key[1]:>3} {us:7.2f} | {gw:19.3f} | {gc:19.3f}")
for band, xs in bands.items():
    print(f"{band}: {len(xs)} settings, warm {gm([x[0] for x in xs]):.3f}, cold {gm([x[1] for x in xs]):.3f}")
PY
