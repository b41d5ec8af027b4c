#!/usr/bin/env bash
# Every GPU test and benchmark in one call, JSON results under OUTDIR (on the device machine: $OUT).
# Usage: benchmarks/gpu/run_all.sh OUTDIR [STAGE ...]
# Stages: tests kernel-tests-rest gpu-tests structured host-loop sampling-ab kernels small-batches ceilings decode decode-sync speculative prefill reference throughput-small throughput-small-sync
#         throughput-8b throughput-8b-sync decode-fp8 decode-int4 gemv-fusion int4-batches throughput-8b-fp8 throughput-8b-fp8kv throughput-8b-quant profile-b256 decode-kv32k attention-32k attention-variants quant-gemm profile-quant pdl attention-tests pdl-launches rotary-tests decode-rotary pdl-probes pdl-early pdl-merge ncu-gemv ncu-decode fp8-pairs fp8-pairs-step server
#         late-compiles fp8-cuda-tests fp8-cuda fp8-cuda-layout fp8-cuda-step attention-pages fp8-cuda-ahead ab-kv32k decode-kv32k-cuda decode-fp8kv-cuda decode-fp8-fp8kv throughput-8b-fp8kv-cuda profile-kv32k-cuda int4-mma-tests int4-mma decode-int4-mma decode-int4-mma-one-row decode-int4-small server-scale server-burst mixed-step embeddings poisson kv-offload moe moe-quant moe-quant-tests moe-int4-sweep int8-rows int8-gemm grouped-sweep int8-tests tp-x2 tp-70b router-x2 disagg-x2 (default:
#         the `stages=` line below; the rest by name, several per call as they fit the device's 600 s.
#         server-scale and server-burst need a call each: --api-server-count 1, 2, 4 at 256 streams, and
#         1, 4 with 1,000 requests at once). The -sync stages rerun with
#         --no-async-scheduling, so async and sync are compared in the same call. gpu-tests: the tests
#         marked gpu, without the kernel tests. The server stage needs
#         the wheels in .whl installed (README of the device tool) and a tokenizer in .gpu_assets/tokenizer.
set -u
out=${1:?usage: run_all.sh OUTDIR [STAGE ...]}
shift
stages=${*:-tests kernels ceilings decode decode-sync prefill reference throughput-small throughput-small-sync throughput-8b throughput-8b-sync server embeddings poisson}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
bench="$py benchmarks/gpu/bench_engine.py"
log() { echo "=== $(date +%T) $*"; }
# The 16 x 32k decode step (8B, bf16 weights; KV32K_QUANT=fp8 for FP8 weights, named _fp8w) with KV cache
# dtype $1 into $out/decode_8b_b16_32k_$2.json.
# The 32k step: three timed runs a process, the median (each ~1 s once the prompts are cached; an H100's
# step read 17.63 and 18.05 ms in two processes a minute apart, fiftieth session).
kv32k_step() {
  timeout 200 $bench decode --shape llama-3.1-8b --batch 16 --input-len 32768 --output-len 64 \
    --max-model-len 33024 --max-num-seqs 16 --repeats 3 --kv-cache-dtype "$1" \
    ${KV32K_QUANT:+--quantization $KV32K_QUANT} \
    --out "$out/decode_8b_b16_32k_$2${KV32K_QUANT:+_${KV32K_QUANT}w}.json" 2>&1 | grep -E '"decode_step_ms"'
}

for stage in $stages; do
  log "$stage"
  case $stage in
    # Every kernel test (on a CPU they run in Triton's interpreter; here on the device), and the tests
    # marked gpu elsewhere.
    # (All of tests/kernels runs past 420 s on the H200: the GEMM kernels' tests in one part, the rest in
    # another, each with its own bound, so that one call holds the stage.)
    tests) timeout 200 $py -m pytest -q tests/kernels/test_skinny_gemm.py tests/kernels/test_int4_gemm.py \
             tests/kernels/test_w4a16_mma.py tests/kernels/test_pdl.py tests/kernels/test_fp8_gemm.py \
             tests/kernels/test_fp8_block_gemm.py tests/kernels/test_fp8_quant.py -p no:cacheprovider \
             --junitxml="$out/kernel_tests_gemm.xml" 2>&1 | tail -5
           timeout 240 $py -m pytest -q -m gpu tests/models tests/layers tests/worker tests/spec_decode -p no:cacheprovider \
             --junitxml="$out/gpu_tests.xml" 2>&1 | tail -25 ;;
    kernel-tests-rest) timeout 560 $py -m pytest -q tests/kernels -p no:cacheprovider --deselect tests/kernels/test_sm90_build.py \
                         --ignore tests/kernels/test_skinny_gemm.py --ignore tests/kernels/test_int4_gemm.py \
                         --ignore tests/kernels/test_w4a16_mma.py --ignore tests/kernels/test_pdl.py \
                         --ignore tests/kernels/test_fp8_gemm.py --ignore tests/kernels/test_fp8_block_gemm.py \
                         --ignore tests/kernels/test_fp8_quant.py --junitxml="$out/kernel_tests_rest.xml" 2>&1 | tail -15 ;;
    # The tensor-core INT4 GEMV (kernels/w4a16_gemv_cuda.py): its tests, the kernel against the Triton
    # one-row kernels by rows with its (warps, tiles, stages) swept, and the batch-1 step with it and without.
    int4-mma-tests) timeout 300 $py -m pytest -q tests/kernels/test_w4a16_gemv_cuda.py tests/kernels/test_int4_gemm.py \
                      -p no:cacheprovider --junitxml="$out/int4_mma_tests.xml" 2>&1 | tail -15 ;;
    int4-mma) timeout 420 $py benchmarks/gpu/bench_quant_gemm.py --int4-mma --rows "${INT4_MMA_ROWS:-1,2,4,8}" \
                ${INT4_MMA_NO_SWEEP:+--no-tile-sweep} --out "$out/int4_mma${INT4_MMA_TAG:-}.json" 2>&1 | tail -3 ;;
    # (INT4_MMA_TILES: "warps,tiles,stages" configs of the CUDA kernel to run beside the default, space-separated)
    decode-int4-mma) for run in 0 1 ${INT4_MMA_TILES:-}; do
                       if [ $run = 0 ]; then env=(TOKENMILL_INT4_MMA_GEMV=0); else env=(TOKENMILL_INT4_MMA_GEMV=1); fi
                       [ $run != 0 ] && [ $run != 1 ] && env+=(TOKENMILL_INT4_MMA_TILES=$run)
                       echo "int4 mma run $run"; env "${env[@]}" timeout 200 $bench decode --shape llama-3.1-8b --max-num-seqs 64 \
                         --quantization int4 --out "$out/decode_8b_int4_mma_${run//,/_}.json" | grep -E "decode_step_ms|ratio_to_plan"
                     done ;;
    # INT4 decode at 2-8 rows with the CUDA GEMV (the default there) and without it, bf16 beside them.
    decode-int4-small) for b in ${INT4_SMALL_BATCHES:-4 8}; do for run in bf16 mma triton; do
                         q=(--quantization int4); [ $run = bf16 ] && q=()
                         echo "batch $b $run"; TOKENMILL_INT4_MMA_GEMV=$([ $run = triton ] && echo 0 || echo 1) \
                           timeout 150 $bench decode --shape llama-3.1-8b --batch $b --max-num-seqs $b --output-len 128 \
                           "${q[@]}" --out "$out/decode_8b_b${b}_$run.json" 2>&1 | grep -E '"decode_step_ms"'
                       done; done ;;
    gpu-tests) timeout 420 $py -m pytest -q -m gpu tests/models tests/layers tests/worker tests/spec_decode \
                 -p no:cacheprovider --junitxml="$out/gpu_tests.xml" 2>&1 | tail -25 ;;
    # Every request under a JSON schema against none, batch 64 (Qwen3-0.6B shape, SmolLM2's tokenizer):
    # throughput and the masks' host time per step.
    structured) model=$($py -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from shapes import shape_dir; \
print(shape_dir('qwen3-0.6b', vocab_size=49152, bos_token_id=1, eos_token_id=2))")
                cp .gpu_assets/tokenizer/* "$model/"
                # Every request under the schema: an array of at least 8 objects, so each request writes
                # its 128 tokens as the unconstrained ones do, through keys, strings, integers and enums.
                schema='{"json": {"type": "array", "minItems": 8, "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}, "required": ["name", "age", "role", "tags"]}}}'
                # The same without its strings' maxLength: llguidance's slicer covers unbounded strings
                # only, so this schema's masks are ~5x cheaper (docs/performance.md, twelfth session).
                unbounded=${schema//, \"maxLength\": 20/}; unbounded=${unbounded//, \"maxLength\": 12/}
                # Three times over, alternating: this host-bound pair drifts by 20% between processes (one
                # machine, 2026-12-04: 0.92x, 0.88x, 0.73x pair by pair); read the ratio of the means
                # (STRUCTURED_ROUNDS=1 or 2 where the device's time is short). The schema without bounds in
                # the first round (STRUCTURED_UNBOUNDED=0: not at all, all: every round). 1,536 requests ~9 s.
                [ "${STRUCTURED_UNBOUNDED:-1}" != 0 ] && first=json_unbounded || first=
                rounds=("" _2 _3); for run in "${rounds[@]:0:${STRUCTURED_ROUNDS:-3}}"; do for so in json none $first; do
                  extra=(); [ $so = json ] && extra=(--structured-outputs "$schema")
                  [ $so = json_unbounded ] && extra=(--structured-outputs "$unbounded")
                  timeout 200 $py -m tokenmill.entrypoints.cli bench throughput --model "$model" --load-format dummy \
                    --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts "${STRUCTURED_PROMPTS:-1536}" \
                    --num-warmups 64 --max-num-seqs 64 "${extra[@]}" --output-json "$out/structured_$so$run.json" \
                    2>&1 | tail -2
                done; [ "${STRUCTURED_UNBOUNDED:-1}" = all ] || first=; done
                [ "${GRAMMAR_HOST:-1}" = 1 ] || continue  # GRAMMAR_HOST=0: the throughput pair alone
                timeout 100 $py benchmarks/grammar_compile.py --model "$model" --out "$out/grammar_compile.json" \
                  2>&1 | tail -3
                # The masks' host time alone: families of compiled copies and threads, with and without
                # an idle gap between steps (the engine's step loop leaves one).
                timeout 150 $py benchmarks/grammar_masks.py --model "$model" --gaps-ms 0,4 \
                  --out "$out/grammar_masks.json" 2>&1 >/dev/null ;;
    # The step loop's host time by phase, unconstrained and under the schema (issue 13), and the masks'
    # fill alone over threads and families.
    host-loop) timeout 200 $py benchmarks/gpu/profile_host_loop.py --tokenizer .gpu_assets/tokenizer \
                 --runs none,12x12,12x64,16x64,8x64,none,12x64 --out "$out/host_loop.json" 2>&1 | grep -E "^(none|json)"
               model=$($py -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from shapes import shape_dir; \
print(shape_dir('qwen3-0.6b', vocab_size=49152, bos_token_id=1, eos_token_id=2))")
               cp .gpu_assets/tokenizer/* "$model/"
               timeout 200 $py benchmarks/grammar_masks.py --model "$model" --threads 1,8,12,16 --families 1,12,64 \
                 --gaps-ms 0 --out "$out/grammar_masks_matrix.json" 2>&1 >/dev/null ;;
    # The one-launch sampling kernel (kernels/sample.py) against the sampler's torch form, unconstrained
    # and under the schema, alternating in one process (profile_host_loop's phases per step).
    sampling-ab) timeout 420 $py benchmarks/gpu/profile_host_loop.py --tokenizer .gpu_assets/tokenizer --requests 1024 \
                   --runs none,none:torch,12x64,12x64:torch,none:torch,none,12x64:torch,12x64 \
                   --out "$out/sampling_ab.json" 2>&1 | grep -E "^(none|json)" | cut -c1-120 ;;
    kernels) timeout 300 $py benchmarks/gpu/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -40 ;;
    # Decode attention at batch 16 and 32k context, bf16 and FP8 caches, over splits, tiles and warps.
    # Decode attention variants at 16 x 32k built from attention.py's text (FP8 KV: layouts, conversion,
    # occupancy, keys as the MMA's M dimension with FP8 tensor cores), against the kernel as it is.
    attention-variants) timeout 400 $py benchmarks/gpu/ab_attention.py --out "$out/attention_variants.json" \
                          2>&1 | grep -v Warning | tail -40 ;;
    # The FP8 cache's whole tiles read as pairs widened in registers (attention.FP8_PAIR_LOADS) against
    # the value-by-value reads, also under register caps: the kernel at 16 x 32k, 256 x 544 and
    # 128 x 1,024 (each case's own tiles and splits). fp8-pairs-step: the decode tests with them on, then
    # the 32k decode step with them (against decode-kv32k's FP8 figure; the step is device-bound).
    fp8-pairs) for case in 16x32768 256x544 128x1024; do timeout 180 $py benchmarks/gpu/ab_attention.py --groups pairs \
                 --case $case --out "$out/fp8_pairs_$case.json" 2>&1 | grep -v Warning | tail -24; done ;;
    fp8-pairs-step) TOKENMILL_FP8_PAIR_LOADS=1 timeout 150 $py -m pytest -q tests/kernels/test_decode_attention.py \
                      tests/kernels/test_attention.py -p no:cacheprovider -k "fp8 or FP8" 2>&1 | tail -3
                    TOKENMILL_FP8_PAIR_LOADS=1 timeout 280 $bench decode --shape llama-3.1-8b --batch 16 --input-len 32768 \
                      --output-len 64 --max-model-len 33024 --max-num-seqs 16 --repeats 1 --kv-cache-dtype fp8 \
                      --out "$out/decode_8b_b16_32k_kv_fp8_pairs.json" ;;
    # The CUDA decode over an FP8 cache (kernels/fp8_decode_cuda.py): its tests and the decode tests routed
    # to it; the kernel by its splits against the Triton ones (16 x 32k, a throughput run's 256 x 544 and
    # 128 x 1,024, 64 x 4,096); the 32k step with it (bf16 KV and the Triton FP8 decode in the same call).
    fp8-cuda-tests) timeout 240 $py -m pytest -q tests/kernels/test_fp8_decode_cuda.py -p no:cacheprovider \
                      --junitxml="$out/fp8_cuda_tests.xml" 2>&1 | tail -15
                    TOKENMILL_FP8_DECODE_CUDA=1 timeout 200 $py -m pytest -q tests/kernels/test_decode_attention.py \
                      tests/kernels/test_attention.py -p no:cacheprovider -k "fp8 or FP8" 2>&1 | tail -5 ;;
    fp8-cuda) for case in ${FP8_CUDA_CASES:-16x32768 256x544 128x1024 64x4096}; do timeout 150 $py \
                benchmarks/gpu/ab_attention.py --groups cuda --case $case --out "$out/fp8_cuda_$case.json" \
                2>&1 | grep -v Warning | tail -10; done ;;
    # The CUDA decode and the bf16 Triton one over token-major and head-major pages, by case.
    fp8-cuda-layout) for case in ${FP8_CUDA_CASES:-16x32768 64x4096 256x544}; do timeout 150 $py \
                benchmarks/gpu/ab_attention.py --groups cuda-layout --case $case --out "$out/fp8_cuda_layout_$case.json" \
                2>&1 | grep -v Warning | tail -12; done ;;
    # The CUDA decode over head-major pages at 16 x 32k with the step's rotary and K/V store in its launch
    # against without, plain launches and with PDL (ab_attention's cuda-step group).
    fp8-cuda-step) for p in "" --pdl; do timeout 150 $py benchmarks/gpu/ab_attention.py --groups cuda-step $p \
                     --case 16x32768 --out "$out/fp8_cuda_step${p:+_pdl}.json" 2>&1 | grep -v Warning | tail -6; done ;;
    # The engine's decodes at 16 x 32k over pages in random order and in the block pool's order (each
    # request's pages consecutive): ab_attention's pages group.
    attention-pages) timeout 200 $py benchmarks/gpu/ab_attention.py --groups pages --case 16x32768 \
                       --out "$out/attention_pages.json" 2>&1 | grep -v Warning | tail -7 ;;
    # The CUDA decode at 16 x 32k over head-major pages in the pool's order by tiles ahead, warps, splits.
    fp8-cuda-ahead) timeout 200 $py benchmarks/gpu/ab_attention.py --groups cuda-ahead --case 16x32768 \
                      --out "$out/fp8_cuda_ahead.json" 2>&1 | grep -v Warning | tail -18 ;;
    # The 32k step of engine variants in one process, timed in turns (ab_decode_step.py; AB_VARIANTS, two at
    # most at 16 x 32k on an H200: the defaults against TILES=2,2 unless set).
    ab-kv32k) timeout 300 $py benchmarks/gpu/ab_decode_step.py --variants ${AB_VARIANTS:-base: ahead2:tiles=2,2} \
                --out "$out/ab_kv32k.json" 2>&1 | grep -E "^round|a step" ;;
    decode-kv32k-cuda) for run in ${KV32K_RUNS:-auto fp8 fp8-cuda}; do
                         TOKENMILL_FP8_DECODE_CUDA=$([ $run = fp8-cuda ] && echo 1 || echo 0) kv32k_step ${run%-cuda} $run
                       done ;;
    # The whole decode step over an FP8 cache at short contexts, the CUDA decode against the Triton one
    # (each with the step's rotary in its launch), by batch.
    decode-fp8kv-cuda) for b in ${FP8KV_BATCHES:-1 64}; do for on in 0 1; do echo "batch $b cuda $on"
                         TOKENMILL_FP8_DECODE_CUDA=$on timeout 150 $bench decode --shape llama-3.1-8b --batch $b \
                           --max-num-seqs $b --kv-cache-dtype fp8 --out "$out/decode_8b_b${b}_kv_fp8_cuda$on.json" \
                           2>&1 | grep -E '"decode_step_ms"'; done; done ;;
    # Issue 11's throughput ratio on the nano-vllm workload: bf16, then FP8 weights + FP8 KV as the engine
    # runs them (cuda: the CUDA decode, its tiles from FP8_TILES = warps,ahead[,min_blocks] if set, and the
    # norms / activation quantizing for the W8A8 linears), with the quantization in the linears' own
    # launches (rowq0), with the Triton decode (triton), and with the O, gate/up and down products' scales
    # left to the norm or activation after them (after: TOKENMILL_FP8_SCALES_AFTER=1; afterN: up to N rows).
    # FP8KV_RUNS picks some.
    throughput-8b-fp8kv-cuda)
      for run in ${FP8KV_RUNS:-bf16 cuda rowq0 triton}; do q=$([ $run = bf16 ] || echo "--quantization fp8 --kv-cache-dtype fp8")
        TOKENMILL_FP8_DECODE_CUDA=$([ $run = triton ] && echo 0 || echo 1) TOKENMILL_FP8_DECODE_TILES=${FP8_TILES:-} \
          TOKENMILL_ROW_QUANT_FUSION=$([ $run = rowq0 ] && echo 0 || echo 1) \
          TOKENMILL_FP8_SCALES_AFTER=$(case $run in after*) echo 1 ;; *) echo 0 ;; esac) \
          TOKENMILL_FP8_SCALES_AFTER_MAX_ROWS=$(case $run in after?*) echo ${run#after} ;; esac) \
          timeout 150 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 $q \
          --out "$out/throughput_llama_8b_fp8kv_$run.json" 2>&1 | grep output_tok_s | tail -1; done ;;
    # Where the 32k step's time goes (its kernels by name, a decode step: a one-token run of the same cached
    # prompts is subtracted): the FP8 cache with the CUDA decode, with PROFILE_KV="fp8 auto" the bf16 one.
    profile-kv32k-cuda) for kv in ${PROFILE_KV:-fp8}; do TOKENMILL_FP8_DECODE_CUDA=1 timeout 200 $py \
                          benchmarks/gpu/profile_decode.py --batch 16 --input-len 32768 --output-len 24 \
                          --max-model-len 33024 --kv-cache-dtype $kv --top 12 --decode-only --cached-prompts \
                          --out "$out/profile_kv32k_$([ $kv = fp8 ] && echo cuda || echo $kv).json" 2>&1 | tail -14; done ;;
    attention-32k) for kv in bf16 fp8; do timeout 200 $py benchmarks/gpu/bench_kernels.py --decode-only --sweep \
                     --decode-cases 16x32768 --kv-dtype $kv --out "$out/attention_32k_$kv.json" 2>&1 | tail -3; done ;;
    profile-quant) for q in fp8 int4; do timeout 150 $py benchmarks/gpu/profile_decode.py --quantization $q \
                     --output-len 128 --top 14 --out "$out/profile_decode_8b_$q.json" | tail -16; done
                   for q in none fp8; do timeout 150 $py benchmarks/gpu/profile_decode.py --batch 128 --output-len 64 \
                     $([ $q = fp8 ] && echo --quantization fp8) --top 14 --out "$out/profile_decode_8b_b128_$q.json" | tail -16
                   done ;;
    quant-gemm) timeout 300 $py benchmarks/gpu/bench_quant_gemm.py --sweep --budget-s 200 --out "$out/quant_gemm.json" \
                  2>&1 | tail -5 ;;
    # Decode batches of 2-4 rows: bf16 cuBLAS against the dense one-row kernel over several rows, FP8's
    # tl.dot kernel against the FP8 one-row kernel over several rows (skinny_gemm.DENSE_ROWS, GEMV8_ROWS).
    small-batches) timeout 300 $py benchmarks/gpu/bench_quant_gemm.py --rows 2,3,4 --shapes qkv,o,gate_up,down,lm_head \
                     --out "$out/small_batches.json" 2>&1 | grep -v Warning | tail -2 ;;
    # The INT8 checkpoints' linears (layers/quantization/int8.py) by batch rows, beside bf16 cuBLAS.
    int8-rows) timeout 300 $py benchmarks/gpu/bench_quant_gemm.py --int8-rows --rows 1,4,16,17,64,256,2048 \
                 --out "$out/int8_rows.json" 2>&1 | tail -3 ;;
    # The INT8 W8A8 GEMM's tiles past 16 rows beside cuBLAS's int8 GEMM; GPTQ 8-bit's grouped kernel's tiles.
    int8-gemm) timeout 190 $py benchmarks/gpu/bench_quant_gemm.py --int8-gemm --rows 32,128,256,2048 --budget-s 110 \
                 --out "$out/int8_gemm.json" 2>&1 >/dev/null | tail -2 | cut -c1-400 ;;
    grouped-sweep) timeout 420 $py benchmarks/gpu/bench_quant_gemm.py --grouped-sweep --rows 16,64,128,256,1024 \
                     --shapes gate_up,o,down --budget-s 300 --out "$out/grouped_sweep.json" 2>"$out/grouped_sweep.err" >/dev/null
                   tail -2 "$out/grouped_sweep.err" | cut -c1-400 ;;
    int8-tests) timeout 120 $py -m pytest -q -p no:cacheprovider tests/kernels/test_dequant8.py \
                  tests/kernels/test_fp8_quant.py tests/layers/test_int8.py 2>&1 | tail -4 ;;
    ceilings) timeout 120 $bench ceilings --out "$out/ceilings.json" ;;
    # Kernel variants a request still compiles on its path after warm-up, by prompt length (bf16, FP8, INT4).
    late-compiles) timeout 560 $py benchmarks/gpu/late_compiles.py --out "$out/late_compiles.json" 2>&1 | tail -30 ;;
    decode) timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --out "$out/decode_8b.json" ;;
    speculative) timeout 480 $bench speculative --shape llama-3.1-8b --out "$out/speculative_8b.json" ;;
    decode-fp8) timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --quantization fp8 \
                  --out "$out/decode_8b_fp8.json" ;;
    # The same with the FP8 KV cache as well (the CUDA decode takes its attention, one launch a layer with
    # its warps merged in the block), beside the goal's FP8-weights figure.
    decode-fp8-fp8kv) timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --quantization fp8 \
                        --kv-cache-dtype fp8 --out "$out/decode_8b_fp8_fp8kv.json" ;;
    throughput-8b-fp8) timeout 480 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 \
                         --quantization fp8 --out "$out/throughput_llama_8b_fp8.json" ;;
    # FP8 weights and an FP8 KV cache together (at 256 requests of up to 1,024 + 1,024 tokens the KV
    # reads rival the weights': FP8 weights alone gave 1.07x).
    throughput-8b-fp8kv) timeout 480 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 \
                           --quantization fp8 --kv-cache-dtype fp8 --out "$out/throughput_llama_8b_fp8_kv.json" ;;
    # bf16, FP8 weights, FP8 weights + FP8 KV on the nano-vllm workload in one stage (the ratios the
    # issue asks for come from one call), then where a 256-request decode step goes in each.
    throughput-8b-quant)
      n=0; for q in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8"; do n=$((n+1))
        timeout 150 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 $q \
          --out "$out/throughput_llama_8b_quant_$n.json" 2>&1 | grep output_tok_s | tail -1; done ;;
    profile-b256) n=0; for q in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8"; do n=$((n+1))
                    timeout 170 $py benchmarks/gpu/profile_decode.py --batch 256 --input-len 512 --output-len 64 \
                      --decode-only --top 10 $q --out "$out/profile_b256_$n.json" 2>&1 | grep -v Warning | tail -12; done ;;
    # Batch-1 decode graphs with and without programmatic dependent launch and the dense one-row GEMV,
    # replayed in turns in one process per dtype (bench_pdl.py).
    pdl) for q in none fp8 int4; do timeout 200 $py benchmarks/gpu/bench_pdl.py \
           $([ $q = none ] || echo --quantization $q) --out "$out/pdl_8b_$q.json" 2>&1 | grep -v Warning | tail -8; done ;;
    # The attention, rotary and norm kernel tests and the greedy-token GPU tests (the decode attention
    # changed without a device: run before its timings).
    attention-tests) timeout 240 $py -m pytest -q tests/kernels/test_attention.py tests/kernels/test_decode_attention.py \
                       tests/kernels/test_rotary.py \
                       tests/kernels/test_norm.py -p no:cacheprovider --junitxml="$out/attention_kernel_tests.xml" \
                       2>&1 | tail -3
                     timeout 240 $py -m pytest -q -m gpu tests/models/test_gpu_equivalence.py -p no:cacheprovider \
                       --junitxml="$out/attention_gpu_tests.xml" 2>&1 | tail -3 ;;
    # Batch-1 decode: the small launches' changes against the default, alternating in one process (the
    # decode attention's own rotary and KV store against the separate launch, reads after the PDL wait).
    pdl-launches) for q in none fp8 int4; do base=pdl-fuse-act; [ $q = none ] && base=triton-pdl-fuse-act
                    timeout 150 $py benchmarks/gpu/bench_pdl.py $([ $q = none ] || echo --quantization $q) \
                      --rounds 7 --variants $base,$base-rotary-in-attention,$base-late-reads --out "$out/pdl_launches_$q.json" \
                      2>&1 | grep -v "Warn\|variant met" | tail -3; done ;;
    # The decode attention's own rotary and KV store (TOKENMILL_DECODE_ROTARY=1) end to end: the
    # greedy-token GPU tests with it on (rotary-tests), then batch-1 decode through the public API, bf16 /
    # FP8 / INT4, with it on and off in turn (decode-rotary).
    rotary-tests) TOKENMILL_DECODE_ROTARY=1 timeout 300 $py -m pytest -q -m gpu tests/models/test_gpu_equivalence.py \
                    tests/layers/test_attention.py tests/spec_decode -p no:cacheprovider \
                    --junitxml="$out/rotary_gpu_tests.xml" 2>&1 | tail -3 ;;
    decode-rotary) for q in none fp8 int4; do for on in 1 0; do
                     TOKENMILL_DECODE_ROTARY=$on timeout 100 $bench decode --shape llama-3.1-8b --max-num-seqs 4 \
                       $([ $q = none ] || echo --quantization $q) --out "$out/decode_8b_${q}_rotary$on.json" \
                       2>&1 | grep -E '"decode_step_ms"' | tail -1
                   done; done ;;
    # Nsight Compute over the 8B's one-row GEMVs (bf16, FP8, INT4 Triton and CUDA; gemv_ncu.py): memory
    # throughput, warp stalls and occupancy of each, cold L2, the card's own clocks.
    ncu-gemv) timeout 400 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
                --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
                $py benchmarks/gpu/gemv_ncu.py > "$out/ncu_gemv.txt" 2>&1
              grep -E "^launch|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Warp|No Eligible|^  [a-z_0-9]+ \(" \
                "$out/ncu_gemv.txt" | head -120 ;;
    # Nsight Compute over the decode attention at 16 x 32k (ab_attention's cuda-short group): the CUDA
    # FP8 decode's first two launches, then the bf16 Triton decode's first (the FP8-KV goal's question:
    # what bounds the FP8 decode on this card, where it reads ~2.8 of the H200's ~4.2 TB/s).
    ncu-decode) for kernel in fp8_decode_attention:2 _paged_attention_kernel:1; do
                  timeout 240 ncu --clock-control none -k "regex:${kernel%:*}" --launch-count "${kernel#*:}" \
                    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
                    --section MemoryWorkloadAnalysis $py benchmarks/gpu/ab_attention.py --groups cuda-short \
                    --case 16x32768 > "$out/ncu_decode_${kernel%:*}.txt" 2>&1
                  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Warp|No Eligible|Block Size|Grid Size" \
                    "$out/ncu_decode_${kernel%:*}.txt" | head -40; done ;;
    # Batch-1 decode with the one-row GEMVs' first 2 and 4 weight tiles before the PDL wait against the
    # first one (skinny_gemm.GEMV_EARLY), bf16 and FP8, alternating in one process each.
    pdl-early) for q in none fp8; do base=pdl-fuse-act; [ $q = none ] && base=triton-pdl-fuse-act
                 timeout 150 $py benchmarks/gpu/bench_pdl.py $([ $q = none ] || echo --quantization $q) \
                   --rounds 7 --variants $base,$base-early2,$base-early4 --out "$out/pdl_early_$q.json" \
                   2>&1 | grep -v "Warn\|variant met" | tail -4; done ;;
    # Batch-1 decode with the Triton decode's KV splits merged in its own launch (kernels/attention.py
    # MERGE_IN_KERNEL) against the merge launch after it, bf16 / FP8 / INT4 weights over a bf16 cache,
    # alternating in one process each.
    pdl-merge) for q in none fp8 int4; do base=pdl-fuse-act; [ $q = none ] && base=triton-pdl-fuse-act
                 timeout 150 $py benchmarks/gpu/bench_pdl.py $([ $q = none ] || echo --quantization $q) \
                   --rounds 7 --variants $base,$base-merge-in-launch --out "$out/pdl_merge_$q.json" \
                   2>&1 | grep -v "Warn\|variant met" | tail -3; done ;;
    # What each small launch costs the FP8 step (bench_pdl --probes: variants that leave one out), and the
    # decode attention tile's pipeline stages, warps and keys.
    pdl-probes) timeout 300 $py benchmarks/gpu/bench_pdl.py --quantization fp8 --probes --variants \
                    pdl-fuse-act,probe-no-norms,probe-no-rotary,probe-no-merge,probe-no-attention,probe-attn-stages-1,probe-attn-stages-2,probe-attn-warps-2,probe-attn-warps-8,probe-attn-keys-32,probe-attn-keys-128,probe-gemvs-only \
                    --out "$out/pdl_probes_fp8.json" 2>&1 | grep -v "Warn\|variant met" | tail -8 ;;
    # Batch-1 decode with and without SiLU-and-multiply folded into the gate/up projection's GEMV store
    # (layers/fused_linear.py's fused_linear; TOKENMILL_GEMV_FUSION: 0 none, act the default); bf16 / FP8
    # / INT4.
    gemv-fusion) for q in none fp8 int4; do for fuse in 0 act; do
                   TOKENMILL_GEMV_FUSION=$fuse timeout 150 $bench decode --shape llama-3.1-8b --max-num-seqs 4 \
                     $([ $q = none ] || echo --quantization $q) --out "$out/decode_8b_${q}_fusion$fuse.json" \
                     2>&1 | grep -E '"decode_step_ms"' | tail -1
                 done; done ;;
    decode-int4) timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --quantization int4 \
                   --out "$out/decode_8b_int4.json" ;;
    # decode-int4 with its one-row GEMVs on the CUDA tensor-core kernel (MIN_ROWS 1) where decode-int4
    # takes the Triton one-row kernels: INT4_ONE_ROW lists its variants as LEAN,UNROLL (default plain, and
    # LEAN unrolled twice); INT4_TAG names the JSON apart, for a patched tree.
    decode-int4-mma-one-row) for v in ${INT4_ONE_ROW:-0,1 1,2}; do lean=${v%,*} unroll=${v#*,}
                   echo "int4 one row on the CUDA kernel, lean $lean unroll $unroll"
                   TOKENMILL_INT4_MMA_MIN_ROWS=1 TOKENMILL_INT4_MMA_LEAN=$lean TOKENMILL_INT4_MMA_UNROLL=$unroll \
                     timeout 200 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --quantization int4 \
                     --out "$out/decode_8b_int4_mma1_lean${lean}_u$unroll${INT4_TAG:-}.json" \
                     | grep -E "decode_step_ms|ratio_to_plan"
                   done ;;
    # INT4 beside bf16 where batches are more than one row: the GEMMs at every batch size (which kernel
    # the INT4 linears take there), decode steps at batch 16 and 64, and the nano-vllm workload.
    int4-batches)
      timeout 300 $py benchmarks/gpu/bench_quant_gemm.py --int4-rows --rows 1,2,3,4,8,16,64,96,128,192,2048 --shapes qkv,o,gate_up,down \
        --out "$out/int4_rows.json" 2>&1 | grep -v Warning | tail -2
      for b in 16 64; do for q in none int4; do
        timeout 150 $bench decode --shape llama-3.1-8b --batch $b --max-num-seqs $b --repeats 2 --output-len 128 \
          $([ $q = none ] || echo --quantization $q) --out "$out/decode_8b_b${b}_$q.json" 2>&1 | grep decode_step_ms | tail -1
      done; done
      timeout 150 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 --quantization int4 \
        --out "$out/throughput_llama_8b_int4.json" 2>&1 | grep output_tok_s | tail -1 ;;
    decode-kv32k) for kv in auto fp8; do timeout 280 $bench decode --shape llama-3.1-8b --batch 16 --input-len 32768 \
                    --output-len 64 --max-model-len 33024 --max-num-seqs 16 --repeats 1 --kv-cache-dtype $kv \
                    --out "$out/decode_8b_b16_32k_kv_$kv.json"; done ;;
    decode-sync) timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 64 --no-async-scheduling \
                   --out "$out/decode_8b_sync.json" ;;
    prefill) timeout 300 $bench prefill --shape llama-3.1-8b --input-len 8192 --max-model-len 8448 \
               --max-num-seqs 16 --out "$out/prefill_8b.json" ;;
    reference)
      TOKENMILL_ATTENTION_BACKEND=torch timeout 300 $bench decode --shape llama-3.1-8b --max-num-seqs 4 \
        --enforce-eager --output-len 64 --out "$out/decode_8b_torch.json"
      TOKENMILL_ATTENTION_BACKEND=torch timeout 300 $bench prefill --shape llama-3.1-8b --input-len 8192 \
        --max-model-len 8448 --max-num-seqs 4 --enforce-eager --out "$out/prefill_8b_torch.json" ;;
    throughput-small) timeout 420 $bench throughput --shape qwen3-0.6b --peer-requests 16 \
                        --out "$out/throughput_qwen3_0.6b.json" ;;
    throughput-small-sync) timeout 300 $bench throughput --shape qwen3-0.6b --peer-requests 0 \
                             --no-async-scheduling --out "$out/throughput_qwen3_0.6b_sync.json" ;;
    throughput-8b) timeout 480 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 16 \
                     --out "$out/throughput_llama_8b.json" ;;
    throughput-8b-sync) timeout 300 $bench throughput --shape llama-3.1-8b --seed 1 --peer-requests 0 \
                          --no-async-scheduling --out "$out/throughput_llama_8b_sync.json" ;;
    server) API_SERVERS="1 4" timeout 480 benchmarks/gpu/serve_vs_offline.sh "$out" ;;
    server-scale) mkdir -p "$out/scale"; API_SERVERS="1 2 4" timeout 560 benchmarks/gpu/serve_vs_offline.sh "$out/scale" ;;
    server-burst) mkdir -p "$out/burst"; CONCURRENCY=1000 NUM_PROMPTS=1000 API_SERVERS="1 4" timeout 560 \
                    benchmarks/gpu/serve_vs_offline.sh "$out/burst" ;;
    mixed-step) timeout 240 $py benchmarks/gpu/profile_mixed_step.py --out "$out/mixed_step.json"
                timeout 240 $py benchmarks/gpu/profile_mixed_step.py --new-per-wave 16 --out "$out/mixed_step_16.json" ;;
    embeddings) timeout 420 $py benchmarks/gpu/bench_embeddings.py --out "$out/embeddings.json" ;;
    # The CPU tier of the prefix cache: copy speed against pinned copies, and multi-turn TTFT with and without
    # (chat turns, four API processes: the configuration of issue 15's figure).
    kv-offload) timeout 120 $py benchmarks/gpu/bench_kv_offload.py --out "$out/kv_offload_copies.json"
                SERVER_EXTRA=${SERVER_EXTRA:---api-server-count 4} timeout 560 benchmarks/gpu/kv_offload_serve.sh \
                  "$out/kv_offload" ;;
    # Mixture of experts (issue 14): the fused kernel against the reference on one Qwen3-30B-A3B layer,
    # then the whole model (dummy weights) on the nano-vllm workload and at batch-1 decode.
    moe) timeout 150 $py benchmarks/gpu/bench_moe.py --out "$out/moe_kernel.json" 2>&1 >/dev/null
         timeout 420 $bench throughput --shape qwen3-30b-a3b --peer-requests 0 --out "$out/throughput_qwen3_30b_a3b.json"
         timeout 300 $bench decode --shape qwen3-30b-a3b --max-num-seqs 64 --out "$out/decode_qwen3_30b_a3b.json" ;;
    # Quantized experts (kernels/fused_moe_quant.py): the fused kernel over Qwen3-30B-A3B's layer held in
    # bf16, FP8 per row, FP8 in 128-column groups, INT4 groups of 128 without and with zero points, INT8
    # per row and in groups of 128 with zero points (GPTQ 8-bit's).
    moe-quant) timeout 300 $py benchmarks/gpu/bench_moe.py --weights bf16,fp8,fp8-block,int4,int4-zp,int8,int8-g128-zp \
                 --tokens 1,8,64,256,1024,4096 --out "$out/moe_quant.json" 2>&1 >/dev/null ;;
    # The quantized experts' kernel and layers on the device (the INT4 PTX unpacking of f47ec98 first ran here).
    moe-quant-tests) timeout 300 $py -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe_quant.py \
                       tests/layers/test_moe_quantized.py --junitxml="$out/moe_quant_tests.xml" 2>&1 | tail -5 ;;
    # The INT4 experts' tiles swept on their own (fused_moe.CONFIGS was swept for bf16), decode to prefill.
    moe-int4-sweep) timeout 540 $py benchmarks/gpu/bench_moe.py --sweep --weights int4 \
                      --tokens 2,8,64,256,1024,4096 --out "$out/moe_int4_sweep.json" 2>&1 | tail -8 ;;
    # Needs nvidia-h200-x2 (issue 14): batch-1 decode of the 8B shape on one GPU and split over two, in
    # the same call; then Qwen3-30B-A3B's throughput over two.
    tp-x2) for tp in 1 2; do timeout 240 $bench decode --shape llama-3.1-8b --max-num-seqs 64 \
             --tensor-parallel-size $tp --out "$out/decode_8b_tp$tp.json"; done
           timeout 420 $bench throughput --shape qwen3-30b-a3b --peer-requests 0 --tensor-parallel-size 2 \
             --out "$out/throughput_qwen3_30b_a3b_tp2.json"
           timeout 420 $bench throughput --shape qwen3-30b-a3b --peer-requests 0 --tensor-parallel-size 2 \
             --enable-expert-parallel --out "$out/throughput_qwen3_30b_a3b_ep2.json" ;;
    # Needs nvidia-h200-x2: the 70B shape split over two GPUs (140 GB of bf16 weights), batch-1 decode.
    tp-70b) timeout 560 $bench decode --shape llama-3.1-70b --max-num-seqs 16 --tensor-parallel-size 2 \
              --out "$out/decode_70b_tp2.json" ;;
    # Needs nvidia-h200-x2: two 8B replicas, cache_aware against round_robin on multi-turn chats.
    router-x2) timeout 560 benchmarks/gpu/router_x2.sh "$out/router" ;;
    # Needs nvidia-h200-x2: one prefill and one decode GPU against two plain replicas, 4k in / 256 out.
    disagg-x2) timeout 560 benchmarks/gpu/disagg_x2.sh "$out/disagg" ;;
    poisson) TRITON_CACHE_DIR=$(mktemp -d) timeout 300 benchmarks/gpu/serve_poisson.sh "$out" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
benchmarks/gpu/pack.sh "$out"  # more than the device returns (8 files): one tarball instead
log done
