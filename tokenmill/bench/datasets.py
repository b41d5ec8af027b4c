"""Benchmark workloads: random, prefix-repetition, multi-turn conversations, ShareGPT files and ShareGPT-like
synthetic chats, and JSONL files/traces."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import numpy as np

from tokenmill.bench.prompts import PromptMaker, SampleRequest
from tokenmill.bench.tokenizer import BenchTokenizer
from tokenmill.bench.traces import file_requests

DATASET_NAMES = ("random", "prefix-repetition", "conversations", "sharegpt", "sharegpt-like", "file")
# vLLM's spellings of the same workloads.
DATASET_ALIASES = {"prefix_repetition": "prefix-repetition"}

# ShareGPT means reported in the vLLM paper (Kwon et al., SOSP 2023, Fig. 11): 161.31 input and
# 337.99 output tokens. Both distributions are long-tailed; lognormals with these means and the
# sigmas below reproduce the shape, clipped as vLLM's ShareGPT loader prunes (prompt <= 1024,
# prompt + output <= 2048, each >= 4).
SHAREGPT_MEAN_INPUT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8
SHAREGPT_MAX_INPUT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
SHAREGPT_MIN_LEN = 4
# Everyday English words for the synthetic conversations.
_WORD_LIST = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had "
    "by not word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water "
    "than call first who may down side been now find any new work part take get place made live where "
    "after back little only round man year came show every good me give our under name very through "
    "just form sentence great think say help low line differ turn cause much mean before move right boy "
    "old too same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light"
)
_WORDS = _WORD_LIST.split()


def random_requests(
    tokenizer: BenchTokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """Random tokens; input and output lengths uniform in [L*(1-r), L*(1+r)], after a shared prefix."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = maker.random_ids(prefix_len)
    requests = []
    for num_input, num_output in zip(input_lens, output_lens, strict=True):
        prompt, prompt_len = maker.prompt(prefix + maker.random_ids(num_input), as_token_ids)
        requests.append(SampleRequest(prompt, prompt_len, max(num_output, 1)))
    return requests


def prefix_repetition_requests(
    tokenizer: BenchTokenizer,
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each followed by distinct suffixes; shuffled so reuse interleaves."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prefixes = [maker.random_ids(prefix_len) for _ in range(num_prefixes)]
    requests = []
    for index in range(num_prompts):
        ids = prefixes[index % num_prefixes] + maker.random_ids(suffix_len)
        prompt, prompt_len = maker.prompt(ids, as_token_ids)
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def conversation_requests(
    tokenizer: BenchTokenizer,
    *,
    num_prompts: int,
    num_conversations: int,
    system_prompt_len: int,
    num_system_prompts: int,
    turn_len: int,
    output_len: int,
    seed: int = 0,
    as_token_ids: bool = False,
    as_messages: bool = False,
) -> list[SampleRequest]:
    """Multi-turn chats: each conversation opens with one of `num_system_prompts` shared system prompts,
    and each turn's prompt is the previous one plus its answer plus a new user message of `turn_len`
    tokens (the answers are random tokens of `output_len`, standing in for what the model said). Requests
    come turn by turn across conversations (every conversation's first turn in a random order, then every
    second turn...),
    so at a request rate R a conversation's next turn arrives about num_conversations / R seconds after
    the last: the working set is the system prompts plus every conversation's growing history.

    as_messages: each request carries the conversation as chat turns (system, user, assistant, ...) for
    a chat endpoint, which renders them with the model's template; otherwise one running text."""
    if min(num_conversations, num_system_prompts) < 1:
        raise ValueError("--conversation-num and --conversation-num-system-prompts must be >= 1")
    if min(system_prompt_len, turn_len, output_len) < 1:
        raise ValueError("--conversation-system-len, -turn-len and -output-len must be >= 1")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)

    def turn(role: str, num_tokens: int) -> list[int] | tuple[dict, int]:
        """A turn's token ids; as a message, its text fitted to its length on its own."""
        ids = maker.random_ids(num_tokens)
        if not as_messages:
            return ids
        text, length = maker.fit_text(ids, num_tokens)
        return {"role": role, "content": text}, length

    systems = [turn("system", system_prompt_len) for _ in range(num_system_prompts)]
    histories = [[systems[c % num_system_prompts]] for c in range(num_conversations)]
    requests = []
    while len(requests) < num_prompts:
        # Each round in its own order: a fixed one would let round-robin over an even number of
        # replicas send every conversation to the same replica every turn.
        for index in rng.permutation(num_conversations)[: num_prompts - len(requests)]:
            history = histories[index]
            history.append(turn("user", turn_len))
            if as_messages:
                messages = tuple(message for message, _ in history)
                prompt = "\n".join(message["content"] for message in messages)
                prompt_len = sum(length for _, length in history)
            else:
                messages = None
                prompt, prompt_len = maker.prompt([t for ids in history for t in ids], as_token_ids)
            requests.append(SampleRequest(prompt, prompt_len, output_len, messages=messages))
            history.append(turn("assistant", output_len))
    return requests


def sharegpt_like_requests(
    tokenizer: BenchTokenizer,
    *,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """Synthetic user/assistant conversations whose token lengths follow ShareGPT's published shape."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    input_lens = _lognormal_lengths(rng, SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_INPUT_SIGMA, num_prompts)
    input_lens = np.clip(input_lens, 4, SHAREGPT_MAX_INPUT_LEN)
    output_lens = _lognormal_lengths(rng, SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_OUTPUT_SIGMA, num_prompts)
    output_lens = np.clip(output_lens, 4, SHAREGPT_MAX_TOTAL_LEN - input_lens)
    requests = []
    for num_input, num_output in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = tokenizer.encode(_conversation(rng, num_input))[:num_input]
        prompt, prompt_len = maker.prompt(ids, as_token_ids)
        requests.append(SampleRequest(prompt, prompt_len, output_len or num_output))
    return requests


def sharegpt_requests(
    tokenizer: BenchTokenizer,
    path: str,
    *,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """A ShareGPT JSON file, read as vLLM reads it: each conversation's first turn is the prompt and its
    second turn's token count the output length (unless `output_len`).

    Conversations of fewer than 2 turns are dropped and the rest shuffled by Python's `random` seeded
    with `seed`, as vLLM does, so a seed picks the same conversations in both tools. Pairs are pruned
    as vLLM prunes (prompt or reply under 4 tokens, the reply's check skipped for a fixed output_len;
    prompt over 1024; both over 2048). When fewer remain than `num_prompts`, the rest are drawn again
    at random, as vLLM oversamples.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc.msg})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    rng = random.Random(seed)
    rng.shuffle(entries)
    requests = []
    for entry in entries:
        if len(requests) >= num_prompts:
            break
        prompt, reply = (str(turn.get("value", "")) for turn in entry["conversations"][:2])
        prompt_ids = tokenizer.encode(prompt)
        num_output = len(tokenizer.encode(reply)) if output_len is None else output_len
        too_short = len(prompt_ids) < SHAREGPT_MIN_LEN or (
            output_len is None and num_output < SHAREGPT_MIN_LEN
        )
        too_long = len(prompt_ids) > SHAREGPT_MAX_INPUT_LEN or (
            len(prompt_ids) + num_output > SHAREGPT_MAX_TOTAL_LEN
        )
        if too_short or too_long:
            continue
        requests.append(SampleRequest(prompt_ids if as_token_ids else prompt, len(prompt_ids), num_output))
    if not requests:
        raise ValueError(f"--dataset-path {path}: no conversation has two turns of usable length")
    if len(requests) < num_prompts:
        print(
            f"ShareGPT: {len(requests)} usable conversations in {path}; drawing again to make "
            f"{num_prompts} prompts",
            file=sys.stderr,
        )
        rng = random.Random(seed)
        requests += [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests


def _uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> list[int]:
    low = max(int(math.floor(length * (1 - range_ratio))), 1)
    high = max(int(math.ceil(length * (1 + range_ratio))), low)
    return rng.integers(low, high + 1, size=count).tolist()


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, count: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    return np.maximum(np.rint(rng.lognormal(mu, sigma, size=count)), 1).astype(np.int64)


def _conversation(rng: np.random.Generator, num_tokens: int) -> str:
    """User/assistant turns of plain sentences, long enough to cover `num_tokens` tokens."""
    num_turns = int(rng.choice([1, 3, 5], p=[0.6, 0.3, 0.1]))
    words_per_turn = max(2, num_tokens // num_turns + 2)
    turns = []
    for turn in range(num_turns):
        words = [str(w) for w in rng.choice(_WORDS, size=words_per_turn)]
        sentences = [" ".join(words[i : i + 9]).capitalize() + "." for i in range(0, len(words), 9)]
        speaker = "User" if turn % 2 == 0 else "Assistant"
        turns.append(f"{speaker}: {' '.join(sentences)}")
    return "\n".join(turns)


def samples_from_args(args: argparse.Namespace, tokenizer: BenchTokenizer | None) -> list[SampleRequest]:
    """Build the `--dataset-name` workload from the parsed command line."""
    name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    _apply_general_lengths(args)
    if name not in DATASET_NAMES:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if name == "file":
        if not args.dataset_path:
            raise ValueError("--dataset-name file needs --dataset-path FILE.jsonl")
        if args.prompts_as_token_ids and tokenizer is None:
            raise ValueError("--prompts-as-token-ids needs a tokenizer; pass --tokenizer")
        return file_requests(
            args.dataset_path,
            tokenizer,
            num_prompts=args.num_prompts,
            default_output_len=args.file_output_len,
            seed=args.seed,
            as_token_ids=args.prompts_as_token_ids,
        )
    if tokenizer is None:
        raise ValueError(
            f"--dataset-name {name} makes prompts of exact token lengths and needs a tokenizer: "
            "pass --tokenizer DIR|FILE.gguf (or --model as a local path, or 'default')"
        )
    common = {
        "num_prompts": args.num_prompts or 1000,
        "seed": args.seed,
        "as_token_ids": args.prompts_as_token_ids,
    }
    if name == "random":
        return random_requests(
            tokenizer,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            **common,
        )
    if name == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer,
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
            **common,
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json (a ShareGPT file)")
        return sharegpt_requests(tokenizer, args.dataset_path, output_len=args.sharegpt_output_len, **common)
    if name == "conversations":
        return conversation_requests(
            tokenizer,
            num_conversations=args.conversation_num,
            system_prompt_len=args.conversation_system_len,
            num_system_prompts=args.conversation_num_system_prompts,
            turn_len=args.conversation_turn_len,
            output_len=args.conversation_output_len,
            as_messages=getattr(args, "endpoint", None) == "/v1/chat/completions",
            **common,
        )
    return sharegpt_like_requests(tokenizer, output_len=args.sharegpt_output_len, **common)


def _apply_general_lengths(args: argparse.Namespace) -> None:
    """vLLM's --input-len and --output-len: one length for whichever dataset runs."""
    if getattr(args, "input_len", None) is not None:
        args.random_input_len = args.input_len
    output_len = getattr(args, "output_len", None)
    if output_len is not None:
        for name in ("random", "prefix_repetition", "conversation", "sharegpt", "file"):
            setattr(args, f"{name}_output_len", output_len)
