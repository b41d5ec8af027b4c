#!/usr/bin/env bash
# What the last sessions prepared and no device has run yet, most wanted first, in calls that fit the
# device's 600 s limit: `pending.sh OUTDIR CALL` (CALL 1e, 1, 1b, 1c, 1d, 1f, 2, 2b, 3, 4 or 5). A call that
# tests a patch applies it to the device's copy of the tree with `apply` and takes it out again (none
# does now); run_all.sh holds the stages.
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
  # The nano-vllm ratio (1.357x on an H200, goal 1.4x) with the FP8 linears' scales left to the launch
  # after them past 64 rows (TOKENMILL_FP8_SCALES_AFTER=1, fifty-first session, off): cuBLAS's per-tensor
  # FP8 GEMM at scales 1 in place of the row-wise one, whose tiles leave SMs idle at 128-256 rows of the
  # 8B's O and down (the twentieth session's H200: 77 against 104 us a layer at 128 rows). Its GPU tests
  # (the kernels over ScaledRows, the unit-scale product against the row-wise one, an engine's greedy
  # tokens with it on and off; and the block sizes' and head-major cache's engine tests, the CUDA FP8
  # decode in an engine at last), the GEMMs alone at 32-8192 rows (32 and 64: the Triton FP8 GEMM's
  # sizes, would the per-tensor GEMM serve there too?), then bf16 and the same FP8 + FP8 KV engine with
  # the switch off and on, alternated (`after512`, on up to 512 rows, if the GEMMs say so). ~450 s.
  1e) timeout 150 python3 -m pytest -q tests/kernels/test_scales_after.py tests/kernels/test_block_sizes.py \
        tests/kernels/test_kv_layout.py -p no:cacheprovider --junitxml="$out/scales_after_tests.xml" 2>&1 | tail -3
      timeout 120 python3 benchmarks/gpu/bench_quant_gemm.py --fp8-gemm --rows 32,64,96,128,256,2048,8192 \
        --budget-s 0 --out "$out/fp8_gemm_rows.json" 2>&1 | tail -2
      FP8KV_RUNS="bf16 cuda after cuda after" bash benchmarks/gpu/run_all.sh "$out" \
        throughput-8b-fp8kv-cuda ;;
  # Issue 11's FP8 KV goal on an H200 (forty-ninth session: the 32k step 13.32 ms on head-major pages
  # against bf16 KV's 20.75, 1.56x of the 1.6x asked). Since then (fiftieth session, H100 only): the CUDA
  # decode fuses the step's rotary at last (the engine's float32 cos/sin cache; -1.0% on the H100's 32k
  # step), and two switches wait for this card: the splits merged in the decode's launch
  # (TOKENMILL_FP8_DECODE_MERGE=1, GPU tests never run) and two tiles ahead (TILES=2,2: -1.2% on the
  # H100's kernel). First the CUDA decode's GPU tests (the merge's among them), the kernel sweep over
  # head-major pages in the pool's order (tiles ahead, warps, splits, the merge), then the goal's two
  # steps at the defaults and each switch against the defaults in one process, in turns (ab-kv32k). ~450 s.
  1) timeout 150 python3 -m pytest -q tests/kernels/test_fp8_decode_cuda.py tests/kernels/test_block_sizes.py \
       tests/kernels/test_kv_layout.py -p no:cacheprovider --junitxml="$out/fp8_decode_cuda_tests.xml" 2>&1 | tail -2
     bash benchmarks/gpu/run_all.sh "$out" fp8-cuda-ahead
     KV32K_RUNS="fp8-cuda auto" bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda
     bash benchmarks/gpu/run_all.sh "$out/ahead2" ab-kv32k
     AB_VARIANTS="base: merge:merge=1" bash benchmarks/gpu/run_all.sh "$out/merge" ab-kv32k ;;
  # The 32k goal's two steps with FP8 weights in both (the goal holds the weights' dtype and compares the
  # caches; with bf16 weights ~4.5 ms of each step is the weights' read, the same in both, which is what
  # keeps the FP8 cache's step under 1.6x): the ratio where the weights are FP8 too, as a user of an FP8
  # cache would run, beside the bf16-weights one. ~200 s.
  1d) KV32K_QUANT=fp8 KV32K_RUNS="fp8-cuda auto" bash benchmarks/gpu/run_all.sh "$out" decode-kv32k-cuda ;;
  # The FP8 32k step over pages of 32 tokens against 16 (fifty-second session: every block size is tested
  # now): a head's page is 2 KB of each K and V at 16 tokens, 4 KB at 32, so the decode's reads are runs
  # twice as long and its block table half as long. In one process, in turns (a step moves ~2% between
  # processes). ~300 s.
  1f) AB_VARIANTS="base: block32:block=32" bash benchmarks/gpu/run_all.sh "$out/block" ab-kv32k ;;
  # Where the 32k steps' time goes on an H200, kernel by kernel (without PDL, where a launch's time is its
  # own; the H100's profile, fiftieth session, found the rotary launch the CUDA decode should have fused),
  # the FP8 and the bf16 cache, and the decode over pages in the pool's order against random. ~300 s.
  1c) bash benchmarks/gpu/run_all.sh "$out" attention-pages
      TOKENMILL_PDL=0 PROFILE_KV="fp8 auto" bash benchmarks/gpu/run_all.sh "$out/nopdl" profile-kv32k-cuda ;;
  # The nano-vllm ratio on an H200 (bf16 and FP8 weights + cache: 1.357x in the forty-ninth session,
  # goal 1.4x; the CUDA decode's rotary fused since), FP8 on head-major pages (the default now) and
  # token-major: the prefill side over head-major FP8 pages is untimed. ~230 s.
  1b) FP8KV_RUNS="bf16 cuda" bash benchmarks/gpu/run_all.sh "$out" throughput-8b-fp8kv-cuda
      TOKENMILL_KV_LAYOUT=nhd FP8KV_RUNS="cuda" bash benchmarks/gpu/run_all.sh "$out/nhd" throughput-8b-fp8kv-cuda ;;
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
  # What the forty-ninth session's H200 calls left of issue 11's batch-1 figures: FP8 weights with the
  # FP8 KV cache (the CUDA decode: one attention launch a layer), and the model-level row-quant test (a
  # prefill above the one-row kernels, eager; mended after its forty-sixth-session run). ~150 s.
  3) bash benchmarks/gpu/run_all.sh "$out" decode decode-fp8-fp8kv 2>&1 | grep -E '===|"decode_step_ms"|ratio_to_plan'
     timeout 100 python3 -m pytest -q tests/kernels/test_row_quant_fusion.py -p no:cacheprovider \
       --junitxml="$out/row_quant_tests.xml" 2>&1 | tail -4 ;;
  # The batch-1 FP8 goal's short GEMVs (the 8B's FP8 O and QKV read 2.6 and 3.0 TB/s on the H200, gate+up
  # 4.1): their first 2 and 4 weight tiles (at 4 their whole weights) requested before the PDL wait,
  # while the attention or the norm before them runs, against the first tile only; bf16 and FP8 step
  # graphs in turns (bench_pdl), then the one-row kernel tests. On an H100 (forty-ninth session) FP8
  # lost 4.9% / 7.1% and bf16 gained 0.7% / 0.5%: an H200 check, least wanted. ~200 s.
  4) bash benchmarks/gpu/run_all.sh "$out" pdl-early
     timeout 150 python3 -m pytest -q tests/kernels/test_skinny_gemm.py -k "early or several_rows or first_tiles" \
       -p no:cacheprovider --junitxml="$out/gemv_early_tests.xml" 2>&1 | tail -3 ;;
  # The Triton split decode merging its splits in its own launch (fifty-third session,
  # TOKENMILL_DECODE_MERGE=1, off; the twenty-seventh session's probes put the merge launch at ~1.1 us a
  # layer of the batch-1 FP8 step): its GPU tests (against the merge launch; two layers' decodes sharing
  # the counters in a graph under PDL) and the attention tests, then batch-1 steps with it against the
  # default, bf16 / FP8 / INT4 weights over the bf16 cache (bench_pdl in turns). ~250 s.
  5) timeout 150 python3 -m pytest -q tests/kernels/test_decode_merge.py tests/kernels/test_decode_attention.py \
       -p no:cacheprovider --junitxml="$out/decode_merge_tests.xml" 2>&1 | tail -2
     bash benchmarks/gpu/run_all.sh "$out" pdl-merge ;;
  *) echo "CALL is 1, 1b, 1c, 1d, 1e, 1f, 2, 2b, 3, 4 or 5" >&2; exit 2 ;;
esac
