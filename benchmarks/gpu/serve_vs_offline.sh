#!/usr/bin/env bash
# The server against the offline engine on the same requests, in one call: Qwen3-0.6B shape on dummy
# weights with SmolLM2's tokenizer (vocab 49,152), random prompts of 512 tokens, 256 output tokens,
# EOS ignored, greedy. `tokenmill serve` is loaded with CONCURRENCY streams at a time, then
# `tokenmill bench throughput` runs the same prompts offline; both JSON files land in OUTDIR and the
# ratio is printed and written to OUTDIR/serve_vs_offline.json.
# Usage: benchmarks/gpu/serve_vs_offline.sh OUTDIR
#   env: CONCURRENCY=256 NUM_PROMPTS=1024 INPUT_LEN=512 OUTPUT_LEN=256 PORT=8321 (a CPU smoke run: small ones)
#   ENGINE_EXTRA="--max-num-batched-tokens 2048": more engine flags, for the server and the offline run.
#   SERVER_EXTRA="--max-prefill-tokens-with-decodes 2048": flags for the server only (the offline run
#   keeps the defaults). OFFLINE_JSON=path: take the offline figure from an earlier run in this call.
#   CLIENT_PROCS=4: bench serve --num-client-processes (one client event loop cannot time 256 streams
#   without adding its own delays to the inter-token latencies).
#   API_SERVERS="1 2 4": one server run per --api-server-count, in this order (default: 1), each against
#   the same offline run (OUTDIR/serve_asc$N.json, server_asc$N.log; summary in serve_vs_offline.json).
#   PROFILE=cpu: the CPU use of each server process and the client is sampled each second of the load
#   (OUTDIR/cpu_asc$N.txt), and the offline run is skipped. PROFILE=1: that, and with one API process
#   the API process and the client run under cProfile (OUTDIR/api.prof, client.prof; top functions
#   printed).
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
engine="--load-format dummy --max-model-len 4096 --max-num-seqs 256 ${ENGINE_EXTRA:-}"

profile=${PROFILE:-0}
api_servers=${API_SERVERS:-1}
prof() { [ "$profile" = 1 ] && echo "-m cProfile -o $out/$1.prof"; }
for count in $api_servers; do
  TOKENMILL_STEP_TRACE="$out/steps_asc$count.json" \
    $py $([ "$count" = 1 ] && prof api) -m tokenmill.entrypoints.cli serve --model "$model" $engine \
    ${SERVER_EXTRA:-} --port "$port" --api-server-count "$count" >"$out/server_asc$count.log" 2>&1 &
  server=$!
  for _ in $(seq 180); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  sleep 2  # with several API processes, /health answers once the first of them listens
  if [ "$profile" != 0 ]; then
    # One line a second while the load runs: CPU % of each server process and of the client.
    $py - $server >"$out/cpu_asc$count.txt" <<'EOF' &
import sys, time, psutil
server = psutil.Process(int(sys.argv[1]))
procs = {"main": server}
spawned = [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]
procs.update({f"child{i}": p for i, p in enumerate(spawned)})
helpers = {}  # the bench client's own processes (--num-client-processes), summed into its column
for second in range(600):
    if "client" not in procs:
        me = psutil.Process()
        client = [p for p in me.parent().children() if p.pid not in (me.pid, server.pid)]
        if client:
            procs["client"] = client[0]
            for p in procs.values():
                p.cpu_percent()
            print("  s " + " ".join(f"{name:>7}" for name in procs))
    time.sleep(1)
    try:
        if "client" in procs:
            shares = {name: p.cpu_percent() for name, p in procs.items()}
            shares["client"] += sum(p.cpu_percent() for p in helpers.values())
            for p in procs["client"].children(recursive=True):
                if p.pid not in helpers:
                    helpers[p.pid] = p
                    p.cpu_percent()
            print(f"{second:3d} " + " ".join(f"{v:7.1f}" for v in shares.values()), flush=True)
    except psutil.Error:
        break
EOF
  fi
  $py $([ "$count" = 1 ] && prof client) -m tokenmill.entrypoints.cli bench serve --temperature 0 \
    --base-url "http://127.0.0.1:$port" --tokenizer "$model" $dataset --ignore-eos \
    --max-concurrency "$concurrency" --num-warmups $((concurrency < 32 ? concurrency : 32)) --disable-tqdm \
    --num-client-processes "${CLIENT_PROCS:-4}" \
    --output-json "$out/serve_asc$count.json"
  kill -INT $server
  wait $server
  [ "$profile" != 0 ] && cat "$out/cpu_asc$count.txt"
done
if [ "$profile" != 0 ]; then
  for name in $([ "$profile" = 1 ] && echo api client); do
    [ -f "$out/$name.prof" ] || continue
    $py -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(25)" \
      "$out/$name.prof" | grep -v "^$" | cut -c1-150
  done
  exit 0
fi
if [ -n "${OFFLINE_JSON:-}" ]; then
  cp "$OFFLINE_JSON" "$out/offline.json"
else
  $tm bench throughput --model "$model" $engine $dataset --disable-tqdm --output-json "$out/offline.json"
fi
CLIENT_PROCS=${CLIENT_PROCS:-4} SERVER_EXTRA=${SERVER_EXTRA:-} $py - "$out" "$concurrency" $api_servers <<'EOF'
import json, os, sys
out, concurrency, counts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
offline = json.load(open(f"{out}/offline.json"))["output_tokens_per_second"]
results = []
for count in counts:
    serve = json.load(open(f"{out}/serve_asc{count}.json"))
    summary = serve.get("summary", serve)
    result = {
        "api_server_count": int(count),
        "concurrency": concurrency,
        "client_processes": int(os.environ["CLIENT_PROCS"]),
        "server_extra": os.environ.get("SERVER_EXTRA", ""),
        "serve_output_tok_s": summary["output_throughput"],
        "offline_output_tok_s": offline,
        "ratio": summary["output_throughput"] / offline,
    }
    for key in ("median_tpot_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "p99_ttft_ms", "completed"):
        if key in summary:
            result[key] = summary[key]
    # The issue's burst count: gaps between a stream's chunks over 100 ms.
    result["itl_gaps_over_100ms"] = sum(gap > 0.1 for gaps in serve.get("itls", []) for gap in gaps)
    # The core's side (TOKENMILL_STEP_TRACE): time between steps' outputs leaving the core, over the
    # timed run's span, and the slowest steps by kind. ITL tails the core does not show come later.
    try:
        trace = json.load(open(f"{out}/steps_asc{count}.json"))
    except OSError:
        trace = None
    if trace:
        cols = trace["columns"]
        rows = [dict(zip(cols, row)) for row in trace["rows"]]
        rows = rows[-max(1, int(len(rows) * 0.95)):]  # skip the warm-up's steps at the start
        gaps = sorted((b["sent_s"] - a["sent_s"]) * 1e3 for a, b in zip(rows, rows[1:]))
        pct = lambda xs, q: xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None
        prefill = sorted(r["step_call_ms"] for r in rows if r["tokens"] > r["requests"])
        decode = sorted(r["step_call_ms"] for r in rows if r["tokens"] == r["requests"])
        result["core_send_gap_ms"] = {f"p{q}": pct(gaps, q) for q in (50, 90, 99, 99.9)}
        result["core_send_gaps_over_100ms"] = sum(g > 100 for g in gaps)
        result["core_steps"] = {"decode_only": len(decode), "with_prompt_tokens": len(prefill),
                                "decode_p99_ms": pct(decode, 99), "prompt_p50_ms": pct(prefill, 50),
                                "prompt_p99_ms": pct(prefill, 99)}
    # The API processes' side: receipts at which some open stream had waited over 100 ms, and the
    # slowest processing of one step's outputs (a gap the clients see but neither shows comes later).
    import glob
    waits, slowest = 0, 0.0
    for path in glob.glob(f"{out}/steps_asc{count}.json.api*"):
        api = json.load(open(path))
        rows = [dict(zip(api["columns"], row)) for row in api["rows"]]
        waits += sum(r["longest_wait_ms"] > 100 for r in rows)
        slowest = max([slowest] + [r["process_ms"] for r in rows])
    if waits or slowest:
        result["api_receipts_with_a_wait_over_100ms"] = waits
        result["api_slowest_step_processing_ms"] = slowest
    results.append(result)
print(json.dumps(results, indent=2))
json.dump(results, open(f"{out}/serve_vs_offline.json", "w"), indent=2)
EOF
