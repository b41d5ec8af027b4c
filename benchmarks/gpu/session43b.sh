#!/usr/bin/env bash
# The forty-third session's last device call, trimmed to what little device time was left: the test fix,
# the kernel's tile sweep and PDL, the batch-1 FP8-cache step A/B.
out=${1:?}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
export PYTHONUNBUFFERED=1
TOKENMILL_FP8_DECODE_CUDA=1 timeout 60 python3 -m pytest -q tests/kernels/test_decode_attention.py -p no:cacheprovider -k "pair_loads" 2>&1 | tail -2
timeout 60 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py -p no:cacheprovider -k "tile_config" 2>&1 | tail -2
FP8_CUDA_CASES=16x32768 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda
timeout 60 python3 benchmarks/gpu/ab_attention.py --groups cuda-short --pdl --out "$out/fp8_cuda_pdl_16x32768.json" 2>&1 | grep -v Warning
FP8KV_BATCHES=1 bash benchmarks/gpu/run_all.sh "$out" decode-fp8kv-cuda
