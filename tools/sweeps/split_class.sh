#!/usr/bin/env bash
# Usage on the GPU machine: . tools/gpu_env.sh; OUT=DIR bash tools/sweeps/split_class.sh   (JOBS: compiles)
# The split-K classes of the rules (_split_class "some", "few", "long") on LLM-like shapes of ~32 C tiles of
# 128 x 128 (k/v projections, N = 768-1024, at 256-768 tokens): the rules' first 16 settings next to the splits of
# ~96-128 CTAs that _split_cost ranks below them (512_768_4096 nk: 64 x 128 in split pairs 0.95x of cuBLAS, the
# rules' first 0.82-0.86x, session 11), to calibrate _split_cost on a class rather than one shape.
S="python3 tools/sweep.py --jobs ${JOBS:-16}"
$S --top 16 --shapes 512_1024_4096:both,384_1024_4096:nk,512_768_4096:nk,256_1024_4096:nk,768_1024_4096:nk,512_1024_8192:nk \
  --json "$OUT/sweep_split_class.json" \
  --params '{"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 2}' \
  --params '{"block_m": 128, "block_n": 64, "consumers": 2, "stages": 8, "split_k": 2}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6, "split_k": 4}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6, "split_k": 2}' \
  --params '{"block_m": 64, "block_n": 64, "consumers": 1, "stages": 8, "split_k": 2}' \
  --params '{"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 4}' \
  --params '{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6, "split_k": 2, "k_groups": 2}'
