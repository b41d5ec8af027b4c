"""What a chat request's tokenization costs as its conversation grows, tokenized whole at every turn
against the server's ChatEncoder (serving/chat_encoder.py: earlier turns' pieces cached). The
conversation is the bench's kind (random words of the vocabulary, a system prompt, turns of user and
assistant text); times are the best of --repeats per turn, on one thread.

    python benchmarks/chat_tokenize.py [--tokenizer PATH] [--system-len 1024] [--turn-len 256]
        [--answer-len 128] [--turns 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tokenmill.serving.chat_encoder import ChatEncoder
from tokenmill.serving.prompt import render_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer directory; default: the embedded model's"
    )
    parser.add_argument("--system-len", type=int, default=1024, help="words in the system prompt")
    parser.add_argument("--turn-len", type=int, default=256, help="words in a user turn")
    parser.add_argument("--answer-len", type=int, default=128, help="words in an assistant turn")
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tokenizer is None:
        from tokenmill.loader import resolve_model

        tokenizer = resolve_model("default").load_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(0)
    words = [tokenizer.decode([rng.randrange(tokenizer.vocab_size)]) for _ in range(4096)]

    def text(n: int) -> str:
        return "".join(rng.choice(words) for _ in range(n))

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    encoder = ChatEncoder(tokenizer)
    messages = [{"role": "system", "content": text(args.system_len)}]
    rows = []
    print("turn  tokens  whole ms  pieces ms  ratio")
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": text(args.turn_len)})
        whole = render_prompt(tokenizer, messages=messages)
        # The encoder meets each turn once, as a server does (its first call is the timed one).
        start = time.perf_counter()
        pieced = render_prompt(tokenizer, messages=messages, encode=encoder.encode)
        pieces_ms = (time.perf_counter() - start) * 1e3
        assert pieced == whole, f"turn {turn}: the pieces' ids differ from the whole text's"
        whole_ms = best(lambda: render_prompt(tokenizer, messages=messages))
        rows.append(
            {"turn": turn, "tokens": len(whole.token_ids), "whole_ms": whole_ms, "pieces_ms": pieces_ms}
        )
        ratio = whole_ms / pieces_ms
        print(f"{turn:4d}  {len(whole.token_ids):6d}  {whole_ms:8.2f}  {pieces_ms:9.2f}  {ratio:5.1f}x")
        messages.append({"role": "assistant", "content": text(args.answer_len)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "enabled": encoder.enabled, "turns": rows}, f, indent=1)


if __name__ == "__main__":
    main()
