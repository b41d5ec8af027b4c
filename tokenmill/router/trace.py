"""The requests `router simulate` replays: a synthetic multi-turn chat workload (shared system prompts,
growing histories, think time between turns) or a recorded JSONL trace, each request reduced to its
lengths and the block hashes of its prompt and answer as the engine's prefix cache keys them."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from tokenmill.core.kv_cache import hash_block, root_hash

# Token ids of a named prefix (a recorded trace's prefix_id) sit far below any generated token id, one
# stretch per prefix, so two prefixes never hash alike and a prefix never matches fresh text.
PREFIX_STRIDE = 1 << 32


class TraceRequest(NamedTuple):
    prompt_len: int
    output_len: int
    # Hashes of the full blocks of prompt + answer; the first prompt_len // block_size are the prompt's.
    # Turns of one conversation share one growing list, so a request keeps only its length of it.
    block_hashes: list[int]
    num_blocks: int

    def prompt_hashes(self, block_size: int) -> list[int]:
        return self.block_hashes[: self.prompt_len // block_size]


class Session(NamedTuple):
    """Requests sent one after another: the first at start_s, each later one think_s[i] seconds after
    the answer to the one before it (a user reading and typing). A recorded request is a session of one."""

    start_s: float
    turns: list[TraceRequest]
    think_s: list[float]  # one per turn after the first


class Conversation:
    """Token ids appended to a conversation, kept only as the chain of hashes of its full blocks and the
    tokens of its last, partial block: exactly what `prefix.chain` gives for the whole text."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_hashes: list[int] = []
        self.length = 0
        self._tail: list[int] = []

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens = self._tail + list(token_ids)
        num_full = len(tokens) - len(tokens) % self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else root_hash(None)
        for start in range(0, num_full, self.block_size):
            parent = hash_block(parent, tuple(tokens[start : start + self.block_size]))
            self.block_hashes.append(parent)
        self._tail = tokens[num_full:]
        self.length = len(self.block_hashes) * self.block_size + len(self._tail)

    def request(self, output_ids: Iterable[int], output_len: int) -> TraceRequest:
        """The conversation as a prompt; its answer (output_ids) is appended for the next turn."""
        prompt_len = self.length
        self.extend(output_ids)
        return TraceRequest(prompt_len, output_len, self.block_hashes, self.length // self.block_size)


class FreshTokens:
    """Token ids never seen before: text no cache holds."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, count: int) -> range:
        self._next += count
        return range(self._next - count, self._next)


def synthetic_trace(
    *,
    conversations: int,
    turns: int,
    rate: float,
    system_prompt_len: int,
    num_system_prompts: int,
    user_turn_len: int,
    output_len: int,
    think_time_s: float,
    block_size: int,
    seed: int,
) -> list[Session]:
    """Chats that start as a Poisson process at rate / turns per second (so about `rate` requests a
    second arrive once every conversation is under way), each on one of a few shared system prompts,
    each turn appending the last answer and a new user message. Lengths vary uniformly over half to
    one and a half times their mean; think times are exponential with mean think_time_s."""
    rng = random.Random(seed)
    fresh = FreshTokens()
    system_prompts = [fresh.take(system_prompt_len) for _ in range(num_system_prompts)]
    sessions = []
    start_s = 0.0
    for _ in range(conversations):
        start_s += rng.expovariate(rate / turns)
        conversation = Conversation(block_size)
        conversation.extend(rng.choice(system_prompts))
        requests = []
        for _ in range(turns):
            conversation.extend(fresh.take(_vary(rng, user_turn_len)))
            answer_len = _vary(rng, output_len)
            requests.append(conversation.request(fresh.take(answer_len), answer_len))
        think_s = [rng.expovariate(1 / think_time_s) if think_time_s else 0.0 for _ in range(turns - 1)]
        sessions.append(Session(start_s, requests, think_s))
    return sessions


def _vary(rng: random.Random, mean: int) -> int:
    return max(1, round(mean * rng.uniform(0.5, 1.5)))


def read_trace(path: Path, block_size: int) -> list[Session]:
    """A recorded trace, one JSON object a line, replayed at its own timestamps (seconds; the first
    request arrives at 0). Each line has "timestamp" and "output_len", and its prompt as either
    "prompt_token_ids" (a list of ints), or "prompt_len" with optional "prefix_id" and "prefix_len" (the
    first prefix_len tokens are shared by every line naming that prefix: a system prompt) and optional
    "conversation_id" (the prompt continues that conversation's previous prompt and answer, then new
    text up to prompt_len)."""
    fresh = FreshTokens()
    prefixes: dict[str, int] = {}
    conversations: dict[str, Conversation] = {}
    arrivals: list[tuple[float, TraceRequest]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--trace {path}: cannot read it ({exc.strerror or exc})") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            timestamp, output_len = float(record["timestamp"]), int(record["output_len"])
            if output_len < 1:
                raise ValueError(f"output_len must be >= 1, got {output_len}")
            if "prompt_token_ids" in record:
                conversation = Conversation(block_size)
                conversation.extend(int(token_id) for token_id in record["prompt_token_ids"])
            else:
                conversation = _continued(record, block_size, conversations, prefixes, fresh)
            if conversation.length < 1:
                raise ValueError("the prompt is empty")
            arrivals.append((timestamp, conversation.request(fresh.take(output_len), output_len)))
        except (ValueError, TypeError, KeyError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"--trace {path}, line {number}: {what}") from exc
    if not arrivals:
        raise ValueError(f"--trace {path} holds no requests")
    first = min(timestamp for timestamp, _ in arrivals)
    return [Session(timestamp - first, [request], []) for timestamp, request in arrivals]


def _continued(
    record: dict,
    block_size: int,
    conversations: dict[str, Conversation],
    prefixes: dict[str, int],
    fresh: FreshTokens,
) -> Conversation:
    prompt_len = int(record["prompt_len"])
    conversation_id = record.get("conversation_id")
    conversation = conversations.get(conversation_id) if conversation_id is not None else None
    if conversation is None:
        conversation = Conversation(block_size)
        if "prefix_id" in record:
            base = -PREFIX_STRIDE * (1 + prefixes.setdefault(str(record["prefix_id"]), len(prefixes)))
            prefix_len = min(int(record.get("prefix_len", prompt_len)), prompt_len)
            conversation.extend(range(base, base + prefix_len))
        if conversation_id is not None:
            conversations[conversation_id] = conversation
    if prompt_len < conversation.length:
        raise ValueError(
            f"prompt_len {prompt_len} is shorter than conversation {conversation_id!r} so far "
            f"({conversation.length} tokens of earlier prompts and answers)"
        )
    conversation.extend(fresh.take(prompt_len - conversation.length))
    return conversation
