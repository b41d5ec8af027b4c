#!/usr/bin/env bash
# Issue 16's GPU goal (nvidia-h200-x2): two replicas of the Llama-3.1-8B shape (dummy weights, SmolLM2's
# tokenizer) from `serve --data-parallel-size 2` behind the cache_aware router, and a round_robin
# `tokenmill router` over the same two replicas. The prefix-heavy workload (bench's conversations set:
# 8 shared 2,048-token system prompts, growing histories) at several Poisson rates through each, the
# replicas' prefix caches reset before every run: TTFT percentiles, throughput and the engines' hit
# rates in OUTDIR/router_<policy>_<rate>.json, a summary in OUTDIR/router_summary.json.
# Usage: benchmarks/gpu/router_x2.sh OUTDIR   env: RATES="8 16 32" NUM_PROMPTS=512 PORT=8350
#   MODEL_ARGS (default: the 8B shape) and BENCH_ARGS override the model and the workload (a CPU smoke
#   run: MODEL_ARGS="--model default --dtype float32 --max-model-len 2048" with small BENCH_ARGS).
#   SHARED_GPU=1: both replicas on one GPU (two `serve` processes, each with GPU_SHARE of its memory,
#   default 0.42, behind a cache_aware `tokenmill router`) where only one GPU is lent: the two replicas
#   then share the card's compute and bandwidth, so the figures are a proxy for two GPUs, not the goal.
# Needs the server's wheels installed and .gpu_assets/tokenizer, as serve_vs_offline.sh does.
set -u
out=${1:?usage: router_x2.sh OUTDIR}
mkdir -p "$out"
rates=${RATES:-8 16 32}
num_prompts=${NUM_PROMPTS:-512}
port=${PORT:-8350}
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
if [ -z "${MODEL_ARGS:-}" ]; then
  model=$(PYTHONPATH=$PWD:${PYTHONPATH:-} $py benchmarks/gpu/shapes.py llama-3.1-8b .gpu_assets/tokenizer)
  MODEL_ARGS="--model $model --load-format dummy --max-model-len 16384"
fi
tokenizer=$(echo "$MODEL_ARGS" | sed -E 's/.*--model ([^ ]+).*/\1/')
workload=${BENCH_ARGS:---conversation-num 128 --conversation-system-len 2048 --conversation-num-system-prompts 8 \
--conversation-turn-len 256 --conversation-output-len 128}
if [ "${SHARED_GPU:-0}" = 1 ]; then
  replica_pids=""
  for index in 0 1; do
    $py -m tokenmill.entrypoints.cli serve $MODEL_ARGS --port $((port + 10 + index)) \
      --gpu-memory-utilization "${GPU_SHARE:-0.42}" >"$out/replica$index.log" 2>&1 &
    replica_pids="$replica_pids $!"
    # One at a time: each sizes its KV cache from the memory free when it starts.
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$((port + 10 + index))/health" >/dev/null && break; sleep 0.5; done
  done
  $py -m tokenmill.entrypoints.cli router --port "$port" --policy cache_aware --model "$tokenizer" \
    --backend "http://127.0.0.1:$((port + 10))" --backend "http://127.0.0.1:$((port + 11))" \
    >"$out/router_dp.log" 2>&1 &
  server="$! $replica_pids"
else
  $py -m tokenmill.entrypoints.cli serve $MODEL_ARGS --data-parallel-size 2 --port "$port" \
    --router-policy cache_aware >"$out/router_dp.log" 2>&1 &
  server=$!
fi
replicas() { curl -sf "http://127.0.0.1:$port/router/replicas" | $py -c \
  "import json, sys; print(' '.join(r['url'] for r in json.load(sys.stdin) if r['healthy']))"; }
for _ in $(seq 600); do
  [ "$(replicas 2>/dev/null | wc -w)" = 2 ] && break
  sleep 0.5
done
urls=$(replicas)
echo "replicas: $urls"
backends=""; for url in $urls; do backends="$backends --backend $url"; done
$py -m tokenmill.entrypoints.cli router --port $((port + 1)) --policy round_robin --model "$tokenizer" \
  $backends >"$out/router_rr.log" 2>&1 &
robin=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$((port + 1))/health" >/dev/null && break; sleep 0.5; done
# Warm-up through the cache_aware router (kernels, first-request costs on both replicas).
$py -m tokenmill.entrypoints.cli bench serve --temperature 0 --base-url "http://127.0.0.1:$port" --tokenizer "$tokenizer" \
  --dataset-name random --random-input-len 2048 --random-output-len 16 --num-prompts 16 --max-concurrency 8 \
  --disable-tqdm >/dev/null
for rate in $rates; do
  for policy in round_robin cache_aware; do
    target=$port; [ $policy = round_robin ] && target=$((port + 1))
    for url in $urls; do curl -sf -X POST "$url/reset_prefix_cache" >/dev/null; done
    $py benchmarks/gpu/engine_hits.py $urls >"$out/hits_before.json"
    $py -m tokenmill.entrypoints.cli bench serve --temperature 0 --base-url "http://127.0.0.1:$target" --tokenizer "$tokenizer" \
      --dataset-name conversations $workload --num-prompts "$num_prompts" --request-rate "$rate" --ignore-eos \
      --seed 0 --percentile-metrics ttft,tpot,itl --metric-percentiles 50,90,99 --disable-tqdm \
      --output-json "$out/router_${policy}_${rate}.json" | grep -iE "ttft|throughput" | head -4
    $py benchmarks/gpu/engine_hits.py $urls --since "$out/hits_before.json" \
      --into "$out/router_${policy}_${rate}.json"
  done
done
$py benchmarks/gpu/engine_hits.py --summarise "$out"/router_*_*.json >"$out/router_summary.json"
cat "$out/router_summary.json"
kill -INT $robin $server
wait $robin $server
