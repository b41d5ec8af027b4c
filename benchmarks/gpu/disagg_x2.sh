#!/usr/bin/env bash
# Issue 15's disaggregation goal (nvidia-h200-x2): Llama-3.1-8B shape (dummy weights, SmolLM2's
# tokenizer), 4,096-token prompts and 256-token answers at RATE req/s, against (a) one prefill instance on
# GPU 0 and one decode instance on GPU 1 (the ZMQ/TCP transfer path) and (b) two plain replicas
# behind the router (serve --data-parallel-size 2). Goodput at a TPOT SLO of 30 ms in
# OUTDIR/disagg_<setup>.json, with each side's KV transfer counters.
# Usage: benchmarks/gpu/disagg_x2.sh OUTDIR   env: RATE=2 NUM_PROMPTS=120 PORT=8370
# Needs the server's wheels installed and .gpu_assets/tokenizer, as serve_vs_offline.sh does.
set -u
out=${1:?usage: disagg_x2.sh OUTDIR}
mkdir -p "$out"
rate=${RATE:-2}
num_prompts=${NUM_PROMPTS:-120}
port=${PORT:-8370}
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
model=$(PYTHONPATH=$PWD:${PYTHONPATH:-} $py benchmarks/gpu/shapes.py llama-3.1-8b .gpu_assets/tokenizer)
common="--model $model --load-format dummy --max-model-len 8192 --no-access-log"
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 0.5; done; }
bench() {
  $py -m tokenmill.entrypoints.cli bench serve --temperature 0 --base-url "http://127.0.0.1:$1" --tokenizer "$model" \
    --dataset-name random --random-input-len 4096 --random-output-len 256 --num-prompts "$num_prompts" \
    --request-rate "$rate" --ignore-eos --seed 0 --goodput tpot:30 --percentile-metrics ttft,tpot,itl \
    --metric-percentiles 50,90,99 --disable-tqdm --output-json "$out/disagg_$2.json" | grep -iE "tpot|ttft|goodput"
}
CUDA_VISIBLE_DEVICES=0 $py -m tokenmill.entrypoints.cli serve $common --port $((port + 1)) --kv-role prefill \
  --kv-port $((port + 100)) >"$out/prefill.log" 2>&1 &
prefill=$!
CUDA_VISIBLE_DEVICES=1 $py -m tokenmill.entrypoints.cli serve $common --port "$port" --kv-role decode \
  --kv-peer 127.0.0.1:$((port + 1)) --remote-prefill-min-tokens 1024 >"$out/decode.log" 2>&1 &
decode=$!
wait_up $((port + 1)); wait_up "$port"
bench "$port" disaggregated
for side in "$port" $((port + 1)); do
  curl -s "http://127.0.0.1:$side/metrics" | grep -E "^tokenmill:kv_transfer"
done | tee "$out/disagg_transfers.txt"
kill -INT $decode $prefill; wait $decode $prefill
$py -m tokenmill.entrypoints.cli serve $common --port "$port" --data-parallel-size 2 \
  --router-policy least_load >"$out/plain.log" 2>&1 &
plain=$!
wait_up "$port"; sleep 20  # both replicas up behind the router
bench "$port" replicas
kill -INT $plain; wait $plain
