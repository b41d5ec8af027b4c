"""Long prompts on a CPU server (issue 10): while one 8k-token prompt is prefilled, how long does a
one-token request wait; after the long prompt's client leaves, how soon is the engine free; and how long
does the 8k prefill itself take. Starts `tokenmill serve` on the embedded model and prints JSON.

    python benchmarks/cpu_long_prompt.py [--prompt-tokens 8000] [--port 8011] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time

import httpx
from local_server import local_server

SHORT = {"prompt": [1000], "max_tokens": 1, "temperature": 0}


def timed_short(base: str) -> float:
    start = time.monotonic()
    response = httpx.post(f"{base}/v1/completions", json={"model": "default", **SHORT}, timeout=600)
    response.raise_for_status()
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--delay", type=float, default=5.0, help="seconds into the prefill to act")
    args, serve_flags = parser.parse_known_args()
    base = f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    result: dict[str, float] = {}
    with local_server(serve_flags, args.port):
        timed_short(base)  # warm-up

        def long_prompt(key: str) -> None:
            ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
            start = time.monotonic()
            body = {"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0}
            httpx.post(f"{base}/v1/completions", json=body, timeout=3600).raise_for_status()
            result[key] = time.monotonic() - start

        # 1. A one-token request behind a long prefill; the prefill's own time.
        worker = threading.Thread(target=long_prompt, args=("long_prefill_s",))
        worker.start()
        time.sleep(args.delay)
        result["short_behind_long_s"] = timed_short(base)
        worker.join()

        # 2. The long prompt's client leaves mid-prefill: how soon does a new request get through?
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        body = {"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0}
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{base}/v1/completions", json=body, timeout=args.delay)
        result["short_after_abort_s"] = timed_short(base)
        result["short_idle_s"] = timed_short(base)
    result["prompt_tokens"] = args.prompt_tokens
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
