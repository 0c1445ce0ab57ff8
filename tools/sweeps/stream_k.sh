#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR [SHAPES=...] bash tools/sweeps/stream_k.sh   (JOBS: compiles)
# Stream-K is not in the sm90 family: every setting measured in session 8 was slower than the same tiles whole, and
# as a setting it lengthens the template every LLM prompt carries and changes every sm90 candidate id (a new
# parameter), so tuning databases measured before stop matching. stream_k.patch (beside this script) adds it: the
# kernel that passed 40 GPU checks (tests/test_sm90_family.py -k stream_k), a `stream_k` parameter the search never
# proposes. This script applies it to the working tree it runs in (the device machine's copy), runs the GPU checks,
# then times stream-K against its confound: those settings were all persistent blocks with the smem-staged epilogue,
# a pairing never timed alone. Each base tile (the family's first two, 128x64 and 128x128) as persistent + smem,
# persistent + TMA store, and stream-K with each.
set -e
git apply "$(dirname "$0")/stream_k.patch"
python3 -m pytest -q -m gpu tests/test_sm90_family.py -k stream_k -n 8 2>&1 | tail -2
P='"persistent": true, "split_k": 1, "k_groups": 1, "cluster_m": 1'
python3 tools/sweep.py --top 2 --jobs "${JOBS:-16}" \
  --params '{"block_m": 128, "block_n": 64, "consumers": 2, "stages": 6}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 5}' \
  --update "{$P, \"epilogue\": \"smem\"}" --update "{$P, \"epilogue\": \"tma\"}" \
  --update "{$P, \"epilogue\": \"smem\", \"stream_k\": true}" --update "{$P, \"epilogue\": \"tma\", \"stream_k\": true}" \
  --shapes "${SHAPES:-256_2304_768:kn,4437_512_3584:kn,7214_896_896:kn,1000_1000_1000:kn,512_1024_8192:kn}" \
  --json "$OUT/sweep_stream_k.json"
