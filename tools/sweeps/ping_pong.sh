#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR [SHAPES=...] [BUDGET_S=100] bash tools/sweeps/ping_pong.sh
# Ping-pong consumers (each of two consumer warpgroups owns whole tiles, the block's tiles in turn, so one stores
# while the other multiplies) beside the rules' first three settings and the cooperative persistent tiles of the same
# size, on many-tile problems with a short K (where the epilogue is a large share of a tile) and two long-K controls.
# Warm ratio to cuBLAS, same process; sweep.py --budget-s stops evaluating after BUDGET_S seconds.
SHAPES=${SHAPES:-7214_896_896:both,3072_2304_768:both,12288_1024_64:nk,4732_896_896:nk,3072_8192_1024:nk,6278_12800_1600:nk,16384_1024_1024:nk,3072_4800_1600:nk,4096_4096_4096:nk,4981_4096_11008:nk}
PP='"consumers": 2, "persistent": true, "ping_pong": true'
python3 tools/sweep.py --family sm90_wgmma --jobs "${JOBS:-16}" --top 3 --shapes "$SHAPES" --budget-s "${BUDGET_S:-100}" \
  --params "{\"block_m\": 128, \"block_n\": 128, \"stages\": 4, \"epilogue\": \"tma\", $PP}" \
  --params "{\"block_m\": 128, \"block_n\": 128, \"stages\": 4, \"epilogue\": \"smem\", $PP}" \
  --params "{\"block_m\": 64, \"block_n\": 256, \"stages\": 4, \"epilogue\": \"tma\", $PP}" \
  --params "{\"block_m\": 128, \"block_n\": 192, \"stages\": 3, \"epilogue\": \"tma\", $PP}" \
  --params "{\"block_m\": 64, \"block_n\": 128, \"stages\": 6, \"epilogue\": \"tma\", $PP}" \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4, "epilogue": "tma", "persistent": true}' \
  --params '{"block_m": 256, "block_n": 128, "consumers": 2, "stages": 3, "epilogue": "tma", "persistent": true}' \
  --json "$OUT/sweep_ping_pong.json" > "$OUT/sweep_ping_pong.log" 2>&1
echo "sweep rc=$?"
python3 - "$OUT/sweep_ping_pong.json" <<'PY'
import json, sys
rows = json.loads(open(sys.argv[1]).read())["rows"]
names = {"#0": "rules 1st", "#1": "rules 2nd", "#2": "rules 3rd", "p1": "pp 128x128 tma", "p2": "pp 128x128 smem",
         "p3": "pp 64x256 tma", "p4": "pp 128x192 tma", "p5": "pp 64x128 tma", "p6": "coop 128x128 tma",
         "p7": "coop 256x128 tma"}
table = {}
for r in rows:
    res = r["result"]
    ok = res["status"] == "ok"
    table.setdefault(r["problem"], {})[r["label"]] = (
        f"{res['cublas_warm']['median_us'] / res['warm']['median_us']:.3f}" if ok else res["status"][:7])
print("| problem | " + " | ".join(names.values()) + " |")
for prob, cells in table.items():
    print(f"| {prob} | " + " | ".join(cells.get(k, "-") for k in names) + " |")
PY
