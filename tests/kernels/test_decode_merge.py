"""A split decode that merges its splits in its own launch (kernels/attention.py's MERGE, asked for by
attention.MERGE_IN_KERNEL): the last split program of each request's KV head to finish merges, counting in
split_kv.merge_counts. The same outputs as the merge launch, on the interpreter and (`-m gpu`) on a GPU,
where the counters must also come back to zero between the launches of a CUDA graph under PDL; and the
engine's greedy tokens with and without it (`-m slow`, the interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_attention import BF16_TOL, DEVICE, FP32_TOL, fp8_cache, make_batch, needs_cuda  # noqa: E402
from tests.kernels.test_decode_attention import pdl_graph, step_rotary  # noqa: E402
from tokenmill.kernels import attention, fp8_decode_cuda, reference, split_kv  # noqa: E402

# Requests long and short (a short one leaves splits empty), one with no query token (a graph's padding:
# its rows must be left alone), and the step's key in a split of its own.
SEQ_LENS = [300, 5, 129, 40]
QUERY_LENS = [1, 1, 0, 1]


def decode(batch, merge: bool, monkeypatch, out: torch.Tensor, **hints) -> torch.Tensor:
    """paged_attention's decode, merging in its launch or not; with merge, the merge launch must not run."""
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL", merge)
    launched = []
    merge_launch = split_kv.merge_splits
    monkeypatch.setattr(attention, "merge_splits", lambda *args: launched.append(merge_launch(*args)))
    out = attention.paged_attention(*batch, out=out, max_query_len=1, **hints)
    assert not (merge and launched)
    return out


@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "fp8", "rotary"),
    [
        (4, 4, 64, torch.float32, False, False),  # no GQA
        (6, 2, 48, torch.float32, False, True),  # a group of 3, head_dim not a power of two, the rotary
        (8, 2, 64, torch.bfloat16, False, False),
        (8, 2, 64, torch.bfloat16, True, True),  # an FP8 cache under bf16 queries (Triton's decode)
    ],
)
def test_the_decode_merges_its_splits_as_the_merge_launch_does(
    monkeypatch, num_kv_splits, num_heads, num_kv_heads, head_dim, dtype, fp8, rotary
) -> None:
    monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", False)
    batch = make_batch(
        SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=num_kv_splits
    )
    scales = {}
    if fp8:
        batch, scales = fp8_cache(batch, 0.5, 0.25), dict(k_scale=0.5, v_scale=0.25)
    hints = dict(num_kv_splits=num_kv_splits, **scales)
    sentinel = torch.full_like(batch.query, 7.0)
    outs = {}
    for merge in (False, True):
        # Each run over its own copy of the cache: with the rotary the launch stores the step's key.
        run = batch._replace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
        if rotary:
            hints["rotary"] = step_rotary(run, num_kv_heads, seed=1)
        outs[merge] = decode(run, merge, monkeypatch, sentinel.clone(), **hints)
    counts = split_kv.merge_counts(batch.query.device, 1)
    assert not counts.any(), "the merging programs leave their counters at zero"
    # The same merge (split_kv.merge_head) over the same partials: equal but for the reduction's order.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(outs[True], outs[False], **tol)
    tokens = QUERY_LENS.count(1)
    assert torch.equal(outs[True][tokens:], sentinel[tokens:]), "no row past the requests' tokens is written"
    if not rotary:  # (the reference does not rotate)
        want = reference.paged_attention(
            *batch, k_scale=scales.get("k_scale", 1.0), v_scale=scales.get("v_scale", 1.0)
        )
        torch.testing.assert_close(
            outs[True][:tokens].float(),
            want[:tokens].float(),
            **(FP32_TOL if dtype == torch.float32 else BF16_TOL),
        )


def test_without_splits_there_is_nothing_to_merge(monkeypatch) -> None:
    batch = make_batch([40, 7], [1, 1], 4, 2, 64)
    out = decode(batch, True, monkeypatch, torch.zeros_like(batch.query), num_kv_splits=1)
    torch.testing.assert_close(out, reference.paged_attention(*batch), **FP32_TOL)


@needs_cuda
def test_merging_decodes_replay_in_a_graph_under_pdl(monkeypatch) -> None:
    """Two layers' decodes in a graph with PDL, each merging its splits in its launch and sharing the
    counters (the second starts counting once the first has zeroed them): replayed over new queries, the
    outputs are the eager launches', bit for bit."""
    monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", False)
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL", True)
    batch = make_batch([300, 17, 64, 1], [1] * 4, 32, 8, 128, dtype=torch.bfloat16, seed=3)
    queries = [torch.empty_like(batch.query) for _ in range(2)]
    outs = [torch.zeros_like(batch.query) for _ in range(2)]

    def run() -> None:
        for query, out in zip(queries, outs):
            attention.paged_attention(query, *batch[1:], out=out, max_query_len=1, num_kv_splits=8)

    for query in queries:
        query.normal_()
    run()
    torch.cuda.synchronize()
    graph = pdl_graph(run)
    for _ in range(3):
        for query in queries:
            query.normal_()
        monkeypatch.setattr(attention, "MERGE_IN_KERNEL", False)
        run()  # eagerly, with the merge launch
        torch.cuda.synchronize()
        want = [out.clone() for out in outs]
        monkeypatch.setattr(attention, "MERGE_IN_KERNEL", True)
        for out in outs:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outs, want):
            torch.testing.assert_close(got, expected, **BF16_TOL)
        assert not split_kv.merge_counts(DEVICE, 1).any()


# The engine on the Triton kernels in the CPU's interpreter (~1 min): prompts past 256 tokens, so that
# its decodes split their keys (two splits of the interpreter's nominal 8 multiprocessors).
@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's: the GPU test above runs Triton there"
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_engine_writes_the_same_tokens_with_the_merge_in_the_launch(
    hf_model_dirs, monkeypatch, kv_cache_dtype
) -> None:
    from tests.models.test_llama_equivalence import random_prompts
    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "triton")
    path, _ = hf_model_dirs["llama"]
    prompts = random_prompts([300, 270], seed=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=512,
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    launches = []
    merge_launch = split_kv.merge_splits
    monkeypatch.setattr(attention, "merge_splits", lambda *args: launches.append(merge_launch(*args)))
    tokens, merge_launches = {}, {}
    for merge in (False, True):
        monkeypatch.setattr(attention, "MERGE_IN_KERNEL", merge)
        launches.clear()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[merge] = [output.outputs[0].token_ids for output in outputs]
        merge_launches[merge] = len(launches)
    # The decodes split (a merge launch a layer and step without the switch, none with it).
    assert merge_launches[False] > 0 and merge_launches[True] == 0
    assert tokens[True] == tokens[False]
    assert not split_kv.merge_counts(torch.device("cpu"), 1).any()
