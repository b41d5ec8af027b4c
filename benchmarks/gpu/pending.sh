#!/usr/bin/env bash
# What the last sessions prepared and no device has run yet, most wanted first, in calls that fit the
# device's 600 s limit: `pending.sh OUTDIR CALL` (CALL 1, 1b, 2, 2b, 3, 4 or 5). A call that tests a patch applies it to
# the device's copy of the tree with `apply` and takes it out again (none does now); run_all.sh holds
# the stages.
out=${1:?usage: pending.sh OUTDIR CALL}
call=${2:?usage: pending.sh OUTDIR CALL}
export PYTHONUNBUFFERED=1
# A patch on (or, with -R, off) the device's copy, whole or not at all: a patch whose hunks do not all
# apply is refused before any lands (patch(1) applies the hunks it can: the forty-sixth session's call
# timed a half-patched kernel that way). Returns nonzero then, and the stages after it are skipped.
apply() {
  if command -v patch > /dev/null; then
    patch -p1 --dry-run -f ${2:-} < "$1" > /dev/null || { echo "PATCH DOES NOT APPLY: $1" >&2; return 1; }
    patch -p1 -f ${2:-} < "$1" | tail -1
  else git apply ${2:-} "$1"; fi
}
nvidia-smi --query-gpu=name --format=csv,noheader
case $call in
  # Issue 11's FP8 KV goal on an H200 (the forty-sixth session ran the 32k step on an H100, 17.37 ms with
  # the CUDA decode, where the bf16 cache does not fit): the CUDA decode at 16 x 32k with tiles asked of L2
  # ahead, the loads' L2 fetch size and head-major pages (the H200's FP8 decodes read ~2.8 TB/s of its
  # ~4.2; on the H100 neither L2 switch gained, forty-eighth session), then the goal step: bf16 KV and FP8
  # KV with the CUDA decode, FP8 KV on head-major pages (TOKENMILL_KV_LAYOUT=hnd), at the sweep's fastest
  # variant, and bf16 KV on head-major pages (a layout adopted for both caches moves both). ~480 s.
  1) FP8_CUDA_CASES=16x32768 bash benchmarks/gpu/run_all.sh "$out" fp8-cuda-l2
     KV32K_RUNS="auto fp8-cuda" bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda
     TOKENMILL_KV_LAYOUT=hnd KV32K_RUNS="fp8-cuda" bash benchmarks/gpu/run_all.sh "$out/hnd" decode-kv32k-cuda
     bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-best
     TOKENMILL_KV_LAYOUT=hnd KV32K_RUNS="auto" bash benchmarks/gpu/run_all.sh "$out/hnd" decode-kv32k-cuda ;;
  # The nano-vllm ratio on an H200 (bf16 and main's FP8; 1.437x on an H100 in the forty-sixth session). ~150 s.
  1b) FP8KV_RUNS="bf16 cuda" bash benchmarks/gpu/run_all.sh "$out" throughput-8b-fp8kv-cuda ;;
  # The INT4 GEMV on an H200 (the forty-seventh session's H100 call: the running addresses 10-12% faster,
  # on main since; LEAN and UNROLL 2 no faster there, where the kernel already reads 85-90% of the copy
  # bandwidth; on the H200 it reads ~58%, where fewer instructions should show if anything does): the
  # four variants by shape at 1 and 4 rows beside the Triton one-row kernel (is the one-row rule's
  # bound, QKV and O to the CUDA kernel, right there too?), and batch-1 decode with the rule off and on,
  # alternated (the H100 call ran out of device time before it). ~350 s.
  2) INT4_MMA_NO_SWEEP=1 INT4_MMA_ROWS=1,4 bash benchmarks/gpu/run_all.sh "$out" int4-mma
     for v in 0 "" 0 ""; do echo "one-row bound ${v:-default}"
       TOKENMILL_INT4_MMA_ONE_ROW_MAX=$v timeout 150 python3 benchmarks/gpu/bench_engine.py decode \
         --shape llama-3.1-8b --max-num-seqs 4 --quantization int4 \
         --out "$out/decode_8b_int4_onerow${v:-default}.json" 2>&1 | grep -E '"decode_step_ms"'; done ;;
  # Why the one-row GEMVs read what they read on this card (INT4 ~2.5 TB/s on the H200 where the H100
  # gives 85-90% of its copy bandwidth; FP8's O and QKV 2.6-3.0): Nsight Compute over the 8B's four
  # shapes in bf16, FP8 and both INT4 kernels (warp stalls, occupancy, DRAM throughput), ~120 s.
  # And the same over the decode attention at 16 x 32k (the CUDA FP8 decode, the bf16 Triton one). ~250 s.
  2b) bash benchmarks/gpu/run_all.sh "$out" ncu-gemv ncu-decode ;;
  # Issue 11's batch-1 ratios in one call (bf16, FP8 weights, INT4), FP8 weights with the FP8 KV cache
  # too (the CUDA decode: one attention launch a layer, no split merge). ~300 s.
  # And the model-level row-quant test (a prefill above the one-row kernels, eager; mended after its
  # forty-sixth-session run) and the new L2-request tests of the CUDA decode.
  3) bash benchmarks/gpu/run_all.sh "$out" decode decode-fp8 decode-fp8-fp8kv decode-int4 2>&1 \
       | grep -E '===|"decode_step_ms"|ratio_to_plan'
     timeout 100 python3 -m pytest -q tests/kernels/test_row_quant_fusion.py -p no:cacheprovider \
       --junitxml="$out/row_quant_tests.xml" 2>&1 | tail -4
     timeout 150 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py tests/kernels/test_kv_layout.py \
       -k "l2_requests or tile_config or layout or head_major or block_rows" -p no:cacheprovider \
       --junitxml="$out/fp8_decode_layout_tests.xml" 2>&1 | tail -4 ;;
  # What the forty-sixth session's H100 call left open, least wanted: the 32k step's profile without PDL
  # (with it a launch's time includes its wait for the one before: the split merge read 173 us a layer).
  # (The two-warp blocks' A/B at batch 64 that stood here ran in the forty-ninth session: adopted.) ~150 s.
  4) TOKENMILL_PDL=0 bash benchmarks/gpu/run_all.sh "$out/nopdl" profile-kv32k-cuda ;;
  # The batch-1 FP8 goal's short GEMVs (the 8B's FP8 O and QKV read 2.6 and 3.0 TB/s on the H200, gate+up
  # 4.1): their first 2 and 4 weight tiles (at 4 their whole weights) requested before the PDL wait,
  # while the attention or the norm before them runs, against the first tile only; bf16 and FP8 step
  # graphs in turns (bench_pdl), then the one-row kernel tests. On an H100 (forty-ninth session) FP8
  # lost 4.9% / 7.1% and bf16 gained 0.7% / 0.5%: an H200 check, least wanted. ~200 s.
  5) bash benchmarks/gpu/run_all.sh "$out" pdl-early
     timeout 150 python3 -m pytest -q tests/kernels/test_skinny_gemm.py -k "early or several_rows or first_tiles" \
       -p no:cacheprovider --junitxml="$out/gemv_early_tests.xml" 2>&1 | tail -3 ;;
  *) echo "CALL is 1, 1b, 2, 2b, 3, 4 or 5" >&2; exit 2 ;;
esac
