"""The router's pure parts: the prompt's block hashes equal the engine's own for the same request, the
index finds the longest cached prefix and ages out what a replica's KV pool cannot hold, and each policy
picks what it promises."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.router.index import PrefixIndex
from tokenmill.router.policy import CacheAware, LeastLoad, RoundRobin, make_policy
from tokenmill.router.prefix import PromptHasher, chain
from tokenmill.sampling_params import SamplingParams


def engine_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The block hashes the engine's KV cache manager keys this prompt by."""
    kv = KVCacheManager(num_blocks=128, block_size=block_size)
    request = Request("r", token_ids, SamplingParams(max_tokens=1), cache_salt=cache_salt)
    kv.get_computed_blocks(request)
    kv.allocate_slots(request, len(token_ids))
    request.num_computed_tokens = len(token_ids)  # prefilled: every full block is published
    kv.cache_full_blocks(request)
    return list(request.block_hashes)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.loader import resolve_model

    return resolve_model("default").load_tokenizer()


def test_chain_is_the_engines_block_hash_chain() -> None:
    ids = list(range(1000, 1000 + 83))
    for block_size in (1, 16, 32):
        assert chain(ids, block_size) == engine_hashes(ids, block_size)
    assert len(chain(ids, 16)) == 5  # full blocks only: the partial one is never cached
    # vLLM's cache_salt seeds the chain: the router guesses a salted prompt's blocks as the engine keys them.
    assert chain(ids, 16, "tenant") == engine_hashes(ids, 16, "tenant") != chain(ids, 16)
    hasher = PromptHasher(block_size=16)
    salted = hasher.hashes("/v1/completions", {"prompt": "x" * 200, "cache_salt": "tenant"})
    assert salted == chain("x" * 192, 64, "tenant") != hasher.hashes("/v1/completions", {"prompt": "x" * 200})


def test_chat_and_completion_prompts_hash_as_the_server_tokenizes_them(tokenizer) -> None:
    from tokenmill.entrypoints.openai.protocol import ChatMessage
    from tokenmill.entrypoints.openai.serving_chat import render_chat

    hasher = PromptHasher(tokenizer, block_size=16)
    messages = [
        {"role": "system", "content": "You answer in one short sentence. " * 6},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}],
        },
    ]
    served = render_chat(tokenizer, [ChatMessage.model_validate(m) for m in messages], True).token_ids
    hashes = hasher.hashes("/v1/chat/completions", {"model": "m", "messages": messages})
    assert hashes and hashes == chain(served, 16) == engine_hashes(served, 16)
    text = "Once upon a time, " * 20
    from tokenmill.serving.prompt import render_prompt

    expected = chain(render_prompt(tokenizer, text).token_ids, 16)
    assert hasher.hashes("/v1/completions", {"prompt": text}) == expected
    assert hasher.hashes("/v1/completions", {"prompt": [text, "other"]}) == expected
    assert hasher.hashes("/v1/completions", {"prompt": list(range(40))}) == chain(list(range(40)), 16)


def test_unreadable_prompts_hash_to_nothing_and_text_hashing_keeps_prefixes(tokenizer) -> None:
    hasher = PromptHasher(tokenizer)
    for body in ([], {"messages": "x"}, {"prompt": {"a": 1}}, {"messages": [{"role": "nobody"}]}, {}):
        assert hasher.hashes("/v1/chat/completions", body) == []
        assert hasher.hashes("/v1/completions", body) == []
    text = PromptHasher(None)
    long = {"messages": [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "a" * 70}]}
    other = {"messages": [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "b" * 70}]}
    a, b = text.hashes("/v1/chat/completions", long), text.hashes("/v1/chat/completions", other)
    assert len(a) == len(b) == 6 and a[:4] == b[:4] and a[4] != b[4]  # 384 characters, blocks of 64
    with pytest.raises(ValueError, match="--block-size"):
        PromptHasher(None, block_size=0)


def test_index_matches_the_longest_run_of_leading_blocks() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2, 9])
    index.record("c", [2, 3])  # holds later blocks, not the first: no match
    assert index.match([1, 2, 3, 4, 5], ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}
    assert index.match([1, 2, 9], ["a", "b"]) == {"a": 2, "b": 3}
    assert index.match([], ["a"]) == {"a": 0}
    index.drop("a")
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}


def test_index_ages_out_least_recently_used_blocks_at_capacity() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.record("a", [1, 2, 3])
    index.record("a", [7, 8])  # 1 is the oldest: gone
    assert index.num_blocks("a") == 4
    assert index.match([1, 2], ["a"]) == {"a": 0}
    index.record("a", [2, 3])  # touched: now 7 and 8 are the oldest
    index.set_capacity("a", 2)
    assert index.num_blocks("a") == 2 and index.match([2, 3], ["a"]) == {"a": 2}
    assert index.match([7], ["a"]) == {"a": 0}
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def test_cache_aware_follows_the_prefix_until_its_replica_is_overloaded() -> None:
    policy = CacheAware(balance_threshold=4)
    matched = {"a": 0, "b": 10, "c": 3}
    assert policy.choose(matched, {"a": 0, "b": 4, "c": 0}) == "b"  # 4 over the least: allowed
    assert policy.choose(matched, {"a": 0, "b": 5, "c": 0}) == "c"  # overloaded: least loaded, most held
    assert policy.choose(matched, {"a": 1, "b": 6, "c": 1}) == "c"
    # Equal matches: the less loaded one.
    assert policy.choose({"a": 5, "b": 5}, {"a": 2, "b": 1}) == "b"
    # Nothing held anywhere: the least loaded ones, in turn.
    picks = [policy.choose({"a": 0, "b": 0, "c": 0}, {"a": 1, "b": 0, "c": 0}) for _ in range(4)]
    assert picks == ["b", "c", "b", "c"]


def test_least_load_round_robin_and_random() -> None:
    least = LeastLoad()
    assert least.choose({"a": 9, "b": 0}, {"a": 3, "b": 1}) == "b"
    robin = RoundRobin()
    assert [robin.choose({}, {"a": 0, "b": 9, "c": 0}) for _ in range(4)] == ["a", "b", "c", "a"]
    first = [make_policy("random", seed=3).choose({}, dict.fromkeys("abcd", 0)) for _ in range(3)]
    assert len(set(first)) == 1  # seeded
    with pytest.raises(ValueError, match="--policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="balance_threshold"):
        CacheAware(-1)


def test_hashes_of_every_turn_equal_the_whole_renderings(tokenizer) -> None:
    """The hasher tokenizes through the server's ChatEncoder (earlier turns cached): every turn of a
    growing conversation hashes as tokenizing the whole rendering does."""
    from tokenmill.serving.prompt import render_prompt

    hasher = PromptHasher(tokenizer, block_size=16)
    messages = [{"role": "system", "content": "Be brief and exact.  Numbers as digits.\n"}]
    for turn in range(6):
        messages = [*messages, {"role": "user", "content": f" Turn {turn}: what's {turn} x {turn}?\t"}]
        body = {"messages": messages}
        want = render_prompt(tokenizer, messages=messages).token_ids
        assert hasher.hashes("/v1/chat/completions", body) == chain(want, 16), turn
        messages = [*messages, {"role": "assistant", "content": f"{turn * turn}."}]
    assert hasher.chat_encoder is not None and hasher.chat_encoder.enabled
