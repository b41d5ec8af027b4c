#!/usr/bin/env bash
# Issue 15's TTFT goal: multi-turn chats whose working set is ~4x the device's KV pool, served with and
# without the CPU tier (Llama-3.1-8B shape, dummy weights, SmolLM2's tokenizer). 64 conversations, each
# with its own 1,024-token system prompt, 6 turns of 256 user + 128 answer tokens: ~211k tokens of
# history against a pool of 3,300 blocks (52,800 tokens). TTFT percentiles and the engine's hits per
# tier in OUTDIR/kv_offload_<label>.json; the server's own TTFT and queue-time sums beside them (where the
# client's TTFT goes: the engine's share against the HTTP path's).
# The turns go to the chat endpoint as messages (system, user, assistant, ...), rendered by the model's
# template; ENDPOINT=/v1/completions sends each turn's history as one text instead (tokenized whole in
# every turn: ~10 ms a turn here on the random-token text, which the chat path's piece cache skips).
# Usage: benchmarks/gpu/kv_offload_serve.sh OUTDIR   env: RATE=8 PORT=8360 OFFLOAD_GIB=32
#   MODEL_ARGS / BENCH_ARGS override the model and workload (a CPU smoke run). SERVER_EXTRA: more
#   server flags for both runs (e.g. "--api-server-count 2": the serving path's share of a turn's TTFT,
#   ~17 ms under this load with one API process, is the same with and without the tier).
#   LABELS="offload": one of the two runs only (an A/B of two trees in one call).
#   PROFILE=1: py-spy samples the server (API process and engine core) for 30 s of each run, raw stacks
#   in OUTDIR/pyspy_<label>.txt (needs py-spy, e.g. its wheel among the carried ones).
# Needs the server's wheels installed and .gpu_assets/tokenizer, as serve_vs_offline.sh does.
set -u
out=${1:?usage: kv_offload_serve.sh OUTDIR}
mkdir -p "$out"
rate=${RATE:-8}
port=${PORT:-8360}
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
if [ -z "${MODEL_ARGS:-}" ]; then
  model=$(PYTHONPATH=$PWD:${PYTHONPATH:-} $py benchmarks/gpu/shapes.py llama-3.1-8b .gpu_assets/tokenizer)
  MODEL_ARGS="--model $model --load-format dummy --max-model-len 8192 --num-kv-blocks 3300"
fi
tokenizer=$(echo "$MODEL_ARGS" | sed -E 's/.*--model ([^ ]+).*/\1/')
workload=${BENCH_ARGS:---conversation-num 64 --conversation-num-system-prompts 64 --conversation-system-len 1024 \
--conversation-turn-len 256 --conversation-output-len 128 --num-prompts 384}
for label in ${LABELS:-recompute offload}; do
  extra=""; [ $label = offload ] && extra="--kv-offload-gib ${OFFLOAD_GIB:-32}"
  $py -m tokenmill.entrypoints.cli serve $MODEL_ARGS $extra ${SERVER_EXTRA:-} --port "$port" --no-access-log \
    >"$out/server_kv_$label.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  if [ "${PROFILE:-0}" = 1 ]; then
    # py-spy from PATH, or from the first PYTHONPATH entry's bin (a wheel installed with --target).
    spy=$(command -v py-spy || echo "${PYTHONPATH%%:*}/bin/py-spy")
    (sleep 10; "$spy" record -p "$server" --subprocesses --threads --nonblocking -d 30 -r 200 -f raw \
      -o "$out/pyspy_$label.txt" >/dev/null 2>&1) &
  fi
  $py -m tokenmill.entrypoints.cli bench serve --temperature 0 --base-url "http://127.0.0.1:$port" --tokenizer "$tokenizer" \
    --dataset-name conversations $workload --endpoint "${ENDPOINT:-/v1/chat/completions}" \
    --request-rate "$rate" --ignore-eos --seed 0 \
    --percentile-metrics ttft,tpot --metric-percentiles 50,90,99 --disable-tqdm \
    --output-json "$out/kv_offload_$label.json" | grep -iE "ttft|throughput" | head -4
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^tokenmill:(prefix_cache_(hits|queries)|kv_offload|(time_to_first_token|request_queue_time|request_intake)_seconds_(sum|count))" \
    >"$out/kv_offload_${label}_metrics.txt"
  cat "$out/kv_offload_${label}_metrics.txt"
  kill -INT $server
  wait $server
done
