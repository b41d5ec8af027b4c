#!/usr/bin/env bash
# What the last sessions prepared and no device has run yet, most wanted first, in calls that fit the
# device's 600 s limit: `pending.sh OUTDIR CALL` (CALL 1 or 2). Each call applies the patches it tests
# to the device's copy of the tree and takes them out again; run_all.sh holds the stages.
out=${1:?usage: pending.sh OUTDIR CALL}
call=${2:?usage: pending.sh OUTDIR CALL}
export PYTHONUNBUFFERED=1
# A patch on (or, with -R, off) the device's copy: patch(1) where the image has it, else git apply.
apply() { if command -v patch > /dev/null; then patch -p1 ${2:-} < "$1" | tail -1; else git apply ${2:-} "$1"; fi; }
nvidia-smi --query-gpu=name --format=csv,noheader
case $call in
  # Issue 11's goals on an H200 (the forty-sixth session ran this call on an H100: nano-vllm 1.437x, the
  # FP8 32k step 17.37 ms with the CUDA decode, the bf16 cache does not fit there): the model-level
  # row-quant test with a prefill above the one-row kernels, the 16 x 32k goal step (bf16 KV, the Triton
  # FP8 decode, the CUDA one), the CUDA decode's sweep at 16 x 32k (warps, tiles ahead, splits: is the
  # engine's four-warp rule the H200's best?), the nano-vllm ratio (bf16 and main's FP8). ~470 s.
  1) timeout 100 python3 -m pytest -q tests/kernels/test_row_quant_fusion.py -p no:cacheprovider \
       --junitxml="$out/row_quant_tests.xml" 2>&1 | tail -4
     bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda
     FP8_CUDA_CASES=16x32768 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda
     FP8KV_RUNS="bf16 cuda" bash benchmarks/gpu/run_all.sh "$out" throughput-8b-fp8kv-cuda ;;
  # Where the FP8 32k step's time goes; the INT4 GEMV's address patch (forty-second session): faster than
  # ~2.5 TB/s? Then the 4-bit kernels are issue-bound, and a leaner one-row kernel is the way to the INT4
  # batch-1 goal.
  2) timeout 100 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py -p no:cacheprovider \
       --junitxml="$out/fp8_cuda_tests.xml" 2>&1 | tail -4
     bash benchmarks/gpu/run_all.sh "$out" profile-kv32k-cuda
     # Two-warp blocks for every launch at batch 1 and 64 (the kernel sweep: 194-200 us against the rule's
     # four-warp 211 at 64 x 4k, 377 against 382 at 16 x 32k): the Triton and CUDA steps in tiles_2w/.
     TOKENMILL_FP8_DECODE_TILES=2,1 FP8KV_BATCHES="1 64" bash benchmarks/gpu/run_all.sh "$out/tiles_2w" \
       decode-fp8kv-cuda
     INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_main bash benchmarks/gpu/run_all.sh "$out" int4-mma
     apply docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch
     INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 INT4_MMA_TAG=_addr bash benchmarks/gpu/run_all.sh "$out" \
       int4-mma-tests int4-mma
     apply docs/results/h200-2026-12-06-s42/prepared-int4-mma-addresses.patch -R
     INT4_SMALL_BATCHES=8 bash benchmarks/gpu/run_all.sh "$out" decode-int4-small ;;
  *) echo "CALL is 1 or 2" >&2; exit 2 ;;
esac
