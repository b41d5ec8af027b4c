#!/usr/bin/env bash
# What the last sessions prepared and no device has run yet, most wanted first, in calls that fit the
# device's 600 s limit: `pending.sh OUTDIR CALL` (CALL 1, 2 or 3). Each call applies the patches it tests
# to the device's copy of the tree and takes them out again; run_all.sh holds the stages.
out=${1:?usage: pending.sh OUTDIR CALL}
call=${2:?usage: pending.sh OUTDIR CALL}
here=docs/results/h100-2026-12-07-s43
export PYTHONUNBUFFERED=1
# A patch on (or, with -R, off) the device's copy: patch(1) where the image has it, else git apply.
apply() { if command -v patch > /dev/null; then patch -p1 ${2:-} < "$1" | tail -1; else git apply ${2:-} "$1"; fi; }
nvidia-smi --query-gpu=name --format=csv,noheader
case $call in
  # The CUDA FP8 decode: its tests with the rotary fused (prepared patch), the routed FP8 decode tests, the
  # 32k step against bf16 KV (issue 11's 1.6x goal: an H200 figure), the kernel's tiles and PDL.
  1) apply $here/prepared-fp8-decode-rotary.patch
     timeout 150 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py -p no:cacheprovider \
       --junitxml="$out/fp8_cuda_tests.xml" 2>&1 | tail -4
     bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda
     FP8_CUDA_CASES=256x544 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda
     TOKENMILL_FP8_DECODE_CUDA=1 timeout 90 python3 -m pytest -q tests/kernels/test_decode_attention.py \
       -p no:cacheprovider -k "fp8 or FP8" 2>&1 | tail -4
     FP8_CUDA_CASES=16x32768 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda
     apply $here/prepared-fp8-decode-rotary.patch -R ;;
  # Whether the CUDA FP8 decode may be on by default: the step at batch 1 and 64 with and without it
  # (rotary fused), and where the 32k step's time goes.
  2) apply $here/prepared-fp8-decode-rotary.patch
     FP8KV_BATCHES="1 64" bash benchmarks/gpu/run_all.sh "$out" decode-fp8kv-cuda
     timeout 60 python3 benchmarks/gpu/ab_attention.py --groups cuda-short --pdl \
       --out "$out/fp8_cuda_pdl_16x32768.json" 2>&1 | grep -v Warning
     bash benchmarks/gpu/run_all.sh "$out" profile-kv32k-cuda
     apply $here/prepared-fp8-decode-rotary.patch -R ;;
  # The INT4 GEMV's address patch (forty-second session): faster than ~2.5 TB/s? Then the 4-bit kernels
  # are issue-bound, and a leaner one-row kernel is the way to the INT4 batch-1 goal.
  3) INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_main bash benchmarks/gpu/run_all.sh "$out" int4-mma
     apply docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch
     INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_addr bash benchmarks/gpu/run_all.sh "$out" \
       int4-mma-tests int4-mma
     apply docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch -R
     INT4_SMALL_BATCHES=8 bash benchmarks/gpu/run_all.sh "$out" decode-int4-small ;;
  *) echo "CALL is 1, 2 or 3" >&2; exit 2 ;;
esac
