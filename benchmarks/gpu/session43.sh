#!/usr/bin/env bash
# The forty-third session's second device call (kept for the record; run_all.sh holds the stages), most
# wanted first: a call cut at its time limit keeps what ran.
out=${1:?}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export PYTHONUNBUFFERED=1
TOKENMILL_FP8_DECODE_CUDA=1 timeout 60 python3 -m pytest -q tests/kernels/test_decode_attention.py -p no:cacheprovider -k "pair_loads" 2>&1 | tail -2
timeout 60 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py -p no:cacheprovider -k "tile_config" 2>&1 | tail -2
case "$gpu" in *H200*) bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda ;; esac
FP8_CUDA_CASES=16x32768 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda
timeout 60 python3 benchmarks/gpu/ab_attention.py --groups cuda-short --pdl --out "$out/fp8_cuda_pdl_16x32768.json" 2>&1 | grep -v Warning
FP8KV_BATCHES=1 bash benchmarks/gpu/run_all.sh "$out" decode-fp8kv-cuda
INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_main bash benchmarks/gpu/run_all.sh "$out" int4-mma
patch -p1 < docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch | tail -1
INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_addr bash benchmarks/gpu/run_all.sh "$out" int4-mma-tests int4-mma
patch -R -p1 < docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch | tail -1
