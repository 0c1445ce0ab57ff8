#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR [SHAPES=...] [TOP=2] bash tools/sweeps/pdl.sh   (JOBS: compiles)
# Programmatic dependent launch (PDL) is not in the project: back to back in the warm graphs it gained 4.5% (95
# settings of small and mid-size problems), but where another kernel runs before each launch (the fresh re-check's
# input refill) it lost about a microsecond a launch: the re-check rejected 17 sm80 settings of this sweep and 7
# candidates of one suite run (BENCHMARKS.md, session 17). pdl.patch (beside this script) adds it: both families open with
# griddepcontrol.wait, the build reads the PTX (BuildResult.pdl: every entry waits before any branch, call or memory
# access; an early griddepcontrol.launch_dependents is refused), jobs, the store, the worker, the exported op (C++ and
# Python) launch such kernels through cuLaunchKernelEx with programmatic stream serialization, adversarial fixtures
# and tests, and `tools/sweep.py --no-pdl`. This script applies it to the working tree it runs in (the device
# machine's copy), then times the rules' first TOP settings of both families launched with PDL and without, each run
# next to cuBLAS in its own process, and prints the pairs (fresh: the time where a refill kernel precedes each launch).
set -e
git apply "$(dirname "$0")/pdl.patch"
set +e
SHAPES=${SHAPES:-9_784_560:both,154_240_448:both,3619_160_208:both,3204_8_24:both,142_96_80:both,310_40_928:both,534_32_1120:both,933_6912_16:both,29_120_2824:both,131_400_5632:both,256_2304_768:both,512_4800_1600:both,7214_896_896:both,4437_512_3584:both}
for fam in sm90_wgmma sm80_mma; do
  for mode in pdl no_pdl; do
    python3 tools/sweep.py --family "$fam" --jobs "${JOBS:-16}" --top "${TOP:-2}" --shapes "$SHAPES" \
      $([ "$mode" = no_pdl ] && echo --no-pdl) --json "$OUT/sweep_pdl_${fam}_${mode}.json" > "$OUT/sweep_pdl_${fam}_${mode}.log" 2>&1
    echo "$fam $mode rc=$?"
  done
done
python3 - "$OUT" <<'PY'
import json, math, sys
from pathlib import Path
out = Path(sys.argv[1])
def us(r, key):
    return f"{r[key]['median_us']:7.2f}" if r.get(key) else "      -"
print(f"{'problem':>20} {'family':>10} {'#':>2} | PDL: {'warm':>7} {'fresh':>7} {'x cuBLAS':>8} | plain: {'warm':>7} "
      f"{'fresh':>7} {'x cuBLAS':>8}")
gains = []
for fam in ("sm90_wgmma", "sm80_mma"):
    rows = {m: {(r["problem"], r["label"]): r["result"] for r in
                json.loads((out / f"sweep_pdl_{fam}_{m}.json").read_text())["rows"]} for m in ("pdl", "no_pdl")}
    for key, a in rows["pdl"].items():
        b = rows["no_pdl"].get(key)
        if not b:
            continue
        ra, rb = (r["cublas_warm"]["median_us"] / r["warm"]["median_us"] if r["status"] == "ok" else None
                  for r in (a, b))
        if ra and rb:
            gains.append(ra / rb)
        print(f"{key[0]:>20} {fam[:10]:>10} {key[1]:>2} | {us(a, 'warm')} {us(a, 'fresh')} "
              f"{f'{ra:8.3f}' if ra else a['status'][:8]:>8} | {us(b, 'warm')} {us(b, 'fresh')} "
              f"{f'{rb:8.3f}' if rb else b['status'][:8]:>8}")
if gains:
    print(f"{len(gains)} settings passed both ways: warm ratio with PDL / without, geomean "
          f"{math.exp(sum(map(math.log, gains)) / len(gains)):.3f}")
PY
