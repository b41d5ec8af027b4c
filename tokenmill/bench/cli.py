"""`tokenmill bench serve|throughput|latency`: the flags, named as `vllm bench` names them."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenmill.bench.arrivals import ARRIVAL_PROCESSES
from tokenmill.bench.client import BACKENDS, SAMPLING_PARAMS
from tokenmill.bench.datasets import DATASET_ALIASES, DATASET_NAMES
from tokenmill.bench.metrics import DEFAULT_METRICS, METRICS
from tokenmill.entrypoints.engine_args import parse_json_object


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server over HTTP, or the engine offline")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve(commands)
    _add_throughput(commands)
    _add_latency(commands)


def _run_serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.serve import main

    return main(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import throughput_main

    return throughput_main(args)


def _run_latency(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import latency_main

    return latency_main(args)


def _add_serve(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput, goodput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    target = p.add_argument_group("server")
    target.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--backend",
        choices=BACKENDS,
        help="openai (or vllm): /v1/completions; openai-chat: /v1/chat/completions (default: by --endpoint)",
    )
    target.add_argument(
        "--endpoint", help="default: /v1/completions, or /v1/chat/completions for --backend openai-chat"
    )
    target.add_argument("--model", help="model name sent in requests (default: the server's first model)")
    target.add_argument("--served-model-name", help="name to send when --model is a local path")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    target.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra headers on every request")
    target.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    _add_tokenizer_arg(p)
    _add_dataset_args(p)

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        help="requests/s, or a comma-separated sweep such as 1,2,4,8,inf (default: inf, "
        "or the trace's own timestamps for a file dataset that has them)",
    )
    load.add_argument(
        "--arrival-process", choices=ARRIVAL_PROCESSES, help="default: poisson (gamma if --burstiness)"
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 is Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and not counted")
    load.add_argument(
        "--trace-speedup", type=float, default=1.0, help="replay a trace this many times faster"
    )
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        help="ask the server to generate every requested token (default: on for --dataset-name random, "
        "as vLLM sets it)",
    )
    load.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="spread the requests over this many client processes (hundreds of streams need more "
        "than one event loop to time them); --max-concurrency and warm-ups are divided between them",
    )

    sampling = p.add_argument_group("sampling (sent only when given; otherwise the server's defaults)")
    for name, kind in SAMPLING_PARAMS:
        sampling.add_argument("--" + name.replace("_", "-"), type=kind)
    sampling.add_argument(
        "--extra-body", type=parse_json_object, help="a JSON object merged into every request's body"
    )

    out = p.add_argument_group("results")
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs a request must meet to count, e.g. ttft:500 tpot:50",
    )
    out.add_argument(
        "--percentile-metrics",
        default=",".join(DEFAULT_METRICS),
        help=f"which latencies are reported, from {','.join(METRICS)}",
    )
    out.add_argument("--metric-percentiles", default="99", help="percentiles reported, e.g. 50,90,99.9")
    out.add_argument("--output-json", help="write the results with vLLM's key names (a list for a sweep)")
    out.add_argument(
        "--save-result",
        action="store_true",
        help="write each run's JSON as vLLM names it: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json",
    )
    out.add_argument("--save-detailed", action="store_true", help="--save-result keeps the per-request lists")
    out.add_argument(
        "--append-result", action="store_true", help="append to the result file, one JSON object a line"
    )
    out.add_argument("--result-dir", help="directory for --save-result files (default: the current one)")
    out.add_argument("--result-filename", help="file name for --save-result instead of vLLM's pattern")
    out.add_argument("--label", help="prefix of the result file name (default: the backend)")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="extra keys for the result JSON")
    out.add_argument("--plot", metavar="DIR", help="write latency CDFs (and sweep curves) as PNGs")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_serve)


def _add_throughput(commands: Any) -> None:
    p = commands.add_parser(
        "throughput",
        help="offline: every request handed to the engine at once, EOS ignored",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="default", help="'default', a HF model directory or a .gguf file")
    _add_tokenizer_arg(p)
    _add_dataset_args(p, offline=True)
    _add_engine_args(p)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--num-warmups",
        type=int,
        default=16,
        help="the first N prompts run once (4 tokens each) before the timed run",
    )
    p.add_argument("--output-json")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_run_throughput)


def _add_latency(commands: Any) -> None:
    p = commands.add_parser(
        "latency",
        help="offline: one batch, timed to its first token and its last; per-step decode latency",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="default", help="'default', a HF model directory or a .gguf file")
    _add_tokenizer_arg(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    _add_engine_args(p)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="off by default: every run's prompts are fresh, so caching could only add lookup cost",
    )
    p.add_argument("--output-json")
    p.set_defaults(func=_run_latency)


def _add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        help="HF tokenizer directory, tokenizer.json or .gguf file; 'default' is the embedded SmolLM2 "
        "(default: --model when it is a local path or 'default')",
    )


def _add_dataset_args(p: argparse.ArgumentParser, offline: bool = False) -> None:
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=(*DATASET_NAMES, *DATASET_ALIASES))
    data.add_argument(
        "--dataset-path",
        help="a ShareGPT JSON file for sharegpt; JSONL for file (prompts, or a trace with timestamps)",
    )
    data.add_argument("--num-prompts", type=int, help="default: 1000 (file: every line)")
    data.add_argument("--seed", type=int, default=0)
    random_input = ["--random-input-len", "--input-len"] if offline else ["--random-input-len"]
    random_output = ["--random-output-len", "--output-len"] if offline else ["--random-output-len"]
    data.add_argument(*random_input, dest="random_input_len", type=int, default=1024)
    data.add_argument(*random_output, dest="random_output_len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in L*(1-r)..L*(1+r)"
    )
    data.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every random prompt")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--conversation-num", type=int, default=64, help="conversations (conversations set)")
    data.add_argument("--conversation-system-len", type=int, default=1024, help="tokens per system prompt")
    data.add_argument("--conversation-num-system-prompts", type=int, default=4, help="system prompts shared")
    data.add_argument("--conversation-turn-len", type=int, default=128, help="tokens of each user message")
    data.add_argument("--conversation-output-len", type=int, default=128, help="tokens of each answer")
    data.add_argument(
        "--sharegpt-output-len", type=int, help="sharegpt(-like): one output length instead of the replies'"
    )
    data.add_argument(
        "--file-output-len", type=int, default=128, help="for file lines without an output length"
    )
    if not offline:
        data.add_argument("--input-len", type=int, help="sets --random-input-len, as in vLLM")
        data.add_argument(
            "--output-len",
            type=int,
            help="one output length for every dataset (sets each --*-output-len), as in vLLM",
        )
        data.add_argument(
            "--prompts-as-token-ids",
            action="store_true",
            help="send prompts as token-id lists (completions only)",
        )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    engine = p.add_argument_group("engine")
    engine.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--max-prefill-tokens-with-decodes", type=int)
    engine.add_argument(
        "--structured-outputs",
        type=parse_json_object,
        help='throughput: every request under this constraint, e.g. \'{"json": {"type": "object"}}\' (the '
        "output then reports the masks' host time per step)",
    )
    engine.add_argument(
        "--speculative-config",
        type=parse_json_object,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (the output '
        "then reports the drafts' acceptance)",
    )
    engine.add_argument(
        "--skip-tokenizer-init", action="store_true", help="engine works on token ids only (no detokenizing)"
    )
    engine.add_argument(
        "--quantization",
        help="fp8 | int4: quantize a bf16 checkpoint's linears at load; a quantized checkpoint needs none "
        "(its method, or vLLM's gptq_marlin / awq_marlin, is taken too)",
    )
    engine.add_argument("--kv-cache-dtype", help="auto | fp8: the KV cache in FP8 (e4m3)")
