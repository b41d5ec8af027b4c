"""`tokenmill generate "prompt"` and the interactive `tokenmill chat`: one-off generation in this process
(no server), the text streamed to the terminal as it is produced."""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import TextIO

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.chat_encoder import ChatEncoder
from tokenmill.serving.llm_engine import LLMEngine
from tokenmill.serving.prompt import render_prompt

_request_ids = itertools.count()
# These commands take their sampling from their own flags, not from a generation config: no such options.
_OWN_SAMPLING_DEFAULTS = ("generation_config", "override_generation_config")


def _add_sampling_args(parser: argparse.ArgumentParser, default_temperature: float) -> None:
    # No per-request seed: the engine's --seed already makes a one-off run reproducible.
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)"
    )
    sampling.add_argument(
        "--temperature",
        type=float,
        default=default_temperature,
        help=f"0 is greedy (default: {default_temperature})",
    )
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser(
        "generate",
        help="generate a completion of one prompt",
        description="Complete one prompt and print it.",
    )
    generate.add_argument("prompt", help="the text to complete")
    _add_sampling_args(generate, default_temperature=0.0)
    add_engine_args(generate, exclude=_OWN_SAMPLING_DEFAULTS)
    generate.set_defaults(func=_generate)

    chat = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Chat in the terminal with the model's chat template. /reset clears the conversation, "
        "/exit (or Ctrl-D) quits, Ctrl-C stops a reply.",
    )
    chat.add_argument("--system", help="system prompt")
    _add_sampling_args(chat, default_temperature=0.7)
    add_engine_args(chat, exclude=_OWN_SAMPLING_DEFAULTS)
    chat.set_defaults(func=_chat)


def _sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=max_tokens,
        stop=list(args.stop),
    )


def _make_engine(args: argparse.Namespace) -> LLMEngine:
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    return LLMEngine(engine_config_from_args(args))


def stream_reply(
    engine: LLMEngine,
    prompt: str | list[int],
    params: SamplingParams,
    out: TextIO,
    prompt_text: str | None = None,
) -> str:
    """Run one request to the end, writing its text to `out` as it comes; Ctrl-C aborts it."""
    request_id = f"cli-{next(_request_ids)}"
    engine.add_request(request_id, prompt, params, prompt_text=prompt_text)
    text = ""
    try:
        finished = False
        while not finished:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                delta = output.outputs[0].delta_text
                out.write(delta)
                out.flush()
                text += delta
                finished = output.finished
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    finally:
        out.write("\n")
        out.flush()
    return text


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args, args.max_tokens)  # bad knobs fail before the model loads
    engine = _make_engine(args)
    try:
        stream_reply(engine, args.prompt, params, sys.stdout)
    except KeyboardInterrupt:
        return 130
    return 0


def _chat(args: argparse.Namespace) -> int:
    _sampling_params(args, args.max_tokens)
    engine = _make_engine(args)
    if engine.tokenizer is None:
        raise ValueError("chat needs a tokenizer; drop --skip-tokenizer-init.")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    encoder = ChatEncoder(engine.tokenizer)  # each turn tokenizes only what it adds
    print("Type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        prompt, token_ids = render_prompt(engine.tokenizer, messages=messages, encode=encoder.encode)
        room = engine.max_model_len - len(token_ids)
        if room < 1:
            messages.pop()
            print(
                f"the conversation fills the {engine.max_model_len}-token context; /reset it.",
                file=sys.stderr,
            )
            continue
        params = _sampling_params(args, min(args.max_tokens, room))
        try:
            reply = stream_reply(engine, token_ids, params, sys.stdout, prompt_text=prompt)
        except KeyboardInterrupt:
            messages.pop()  # an interrupted reply is not part of the conversation
            continue
        messages.append({"role": "assistant", "content": reply})
