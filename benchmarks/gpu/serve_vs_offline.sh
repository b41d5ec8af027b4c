#!/usr/bin/env bash
# The server against the offline engine on the same requests, in one call: Qwen3-0.6B shape on dummy
# weights with SmolLM2's tokenizer (vocab 49,152), random prompts of 512 tokens, 256 output tokens,
# EOS ignored, greedy. `tokenmill serve` is loaded with CONCURRENCY streams at a time, then
# `tokenmill bench throughput` runs the same prompts offline; both JSON files land in OUTDIR and the
# ratio is printed and written to OUTDIR/serve_vs_offline.json.
# Usage: benchmarks/gpu/serve_vs_offline.sh OUTDIR
#   env: CONCURRENCY=256 NUM_PROMPTS=1024 INPUT_LEN=512 OUTPUT_LEN=256 PORT=8321 (a CPU smoke run: small ones)
# Needs on the device machine: the server's wheels installed (.whl, see the device README) and the
# tokenizer saved beside the script's config in .gpu_assets/tokenizer (save_pretrained of the embedded
# GGUF's tokenizer).
set -u
out=${1:?usage: serve_vs_offline.sh OUTDIR}
concurrency=${CONCURRENCY:-256}
num_prompts=${NUM_PROMPTS:-1024}
port=${PORT:-8321}
input_len=${INPUT_LEN:-512}
output_len=${OUTPUT_LEN:-256}
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
tm="$py -m tokenmill.entrypoints.cli"
model=$($py -c "import sys; sys.path.insert(0, 'benchmarks/gpu'); from shapes import shape_dir; \
print(shape_dir('qwen3-0.6b', vocab_size=49152, bos_token_id=1, eos_token_id=2))")
cp .gpu_assets/tokenizer/* "$model/"
dataset="--dataset-name random --random-input-len $input_len --random-output-len $output_len \
  --num-prompts $num_prompts \
  --seed 0 --temperature 0"
engine="--load-format dummy --max-model-len 4096 --max-num-seqs 256"

$tm serve --model "$model" $engine --port "$port" >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 180); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 1
done
$tm bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$model" $dataset --ignore-eos \
  --max-concurrency "$concurrency" --num-warmups $((concurrency < 32 ? concurrency : 32)) --disable-tqdm --output-json "$out/serve.json"
kill -INT $server
wait $server
$tm bench throughput --model "$model" $engine $dataset --disable-tqdm --output-json "$out/offline.json"
$py - "$out" "$concurrency" <<'EOF'
import json, sys
out, concurrency = sys.argv[1], int(sys.argv[2])
serve = json.load(open(f"{out}/serve.json"))
offline = json.load(open(f"{out}/offline.json"))
summary = serve.get("summary", serve)
result = {
    "concurrency": concurrency,
    "serve_output_tok_s": summary["output_throughput"],
    "offline_output_tok_s": offline["output_tokens_per_second"],
}
result["ratio"] = result["serve_output_tok_s"] / result["offline_output_tok_s"]
for key in ("median_tpot_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "p99_ttft_ms", "completed"):
    if key in summary:
        result[key] = summary[key]
print(json.dumps(result, indent=2))
json.dump(result, open(f"{out}/serve_vs_offline.json", "w"), indent=2)
EOF
