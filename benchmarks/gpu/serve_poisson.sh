#!/usr/bin/env bash
# Light load on the 8B shape (issue 10's tail-latency goal): Llama-3.1-8B shape on dummy weights with
# SmolLM2's tokenizer, sharegpt-like prompts arriving as a Poisson process at RATE req/s, after start-up;
# TTFT percentiles in OUTDIR/poisson_<label>.json. Run twice in one call to compare start-up warm-up on and
# off: LABEL=warm (default) and LABEL=cold EXTRA="--no-warmup".
# Usage: benchmarks/gpu/serve_poisson.sh OUTDIR   env: RATE=4 NUM_PROMPTS=240 PORT=8341 LABEL EXTRA
# Needs the server's wheels installed and .gpu_assets/tokenizer, as serve_vs_offline.sh does.
set -u
out=${1:?usage: serve_poisson.sh OUTDIR}
rate=${RATE:-4}
num_prompts=${NUM_PROMPTS:-240}
port=${PORT:-8341}
label=${LABEL:-warm}
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
model=$($py -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from shapes import shape_dir; \
print(shape_dir('llama-3.1-8b', vocab_size=49152, bos_token_id=1, eos_token_id=2))")
cp .gpu_assets/tokenizer/* "$model/"
start=$(date +%s.%N)
$py -m tokenmill.entrypoints.cli serve --model "$model" --load-format dummy --max-model-len 8192 \
  --port "$port" --no-access-log ${EXTRA:-} >"$out/server_poisson_$label.log" 2>&1 &
server=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
echo "$label: ready after $(python3 -c "import sys, time; print(f\"{time.time() - float(sys.argv[1]):.1f}\")" "$start") s"
grep -h "warm-up" "$out/server_poisson_$label.log"
$py -m tokenmill.entrypoints.cli bench serve --temperature 0 --base-url "http://127.0.0.1:$port" --tokenizer "$model" \
  --dataset-name sharegpt-like --num-prompts "$num_prompts" --request-rate "$rate" --seed 0 \
  --percentile-metrics ttft,tpot,itl --metric-percentiles 50,90,99 \
  --disable-tqdm --output-json "$out/poisson_$label.json" | grep -iE "ttft|tpot|itl|throughput|duration"
kill -INT $server
wait $server
