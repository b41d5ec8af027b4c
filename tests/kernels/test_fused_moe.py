"""Triton fused MoE against the torch reference on awkward token counts, expert counts and widths, with
experts that receive no token; and the alignment's invariants (every pair once, runs padded per expert)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import fused_moe, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def routing(tokens: int, num_experts: int, top_k: int, dtype, gen, starve: int = 0):
    """Random distinct top-k experts per token, never the last `starve` experts; weights summing to 1."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    if starve:
        scores[:, -starve:] = -1
    weights, experts = torch.topk(scores, top_k, dim=-1)
    weights = torch.softmax(weights, dim=-1)
    return experts.to(DEVICE), weights.to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 3, 1, 40, 24), (7, 8, 2, 72, 40), (37, 5, 3, 48, 100), (130, 16, 2, 64, 48)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(tokens, num_experts, top_k, hidden, inter, dtype) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    starve = 1 if num_experts - 1 >= top_k else 0
    experts, weights = routing(tokens, num_experts, top_k, dtype, gen, starve)
    got = fused_moe.fused_moe(x, w13, w2, experts, weights)
    want = reference.fused_moe(x, w13, w2, experts, weights)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "block_m", "other_rank"),
    [(29, 6, 2, 16, False), (300, 6, 2, 16, True), (97, 128, 8, 32, False), (5, 3, 1, 64, True)],
)
def test_alignment_pads_each_expert_run_and_keeps_every_pair_once(
    tokens, num_experts, top_k, block_m, other_rank
):
    """Over one chunk of pairs and over many (whose programs claim slots concurrently); with ids of
    num_experts (another rank's experts), which get no slot."""
    gen = torch.Generator().manual_seed(tokens)
    experts, _ = routing(tokens, num_experts, top_k, torch.float32, gen, starve=min(2, num_experts - top_k))
    if other_rank:
        experts[::3, 0] = num_experts
    pairs, block_experts, num_padded = fused_moe.align_by_expert(experts, num_experts, block_m)
    pairs, block_experts, used = pairs.cpu(), block_experts.cpu(), int(num_padded)
    flat = experts.reshape(-1).cpu()
    real = pairs[pairs < flat.numel()]
    here = (flat < num_experts).nonzero().flatten()
    assert sorted(real.tolist()) == here.tolist()  # every (token, slot) of an expert here once
    counts = torch.bincount(flat[here], minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert (pairs[used:] == flat.numel()).all()
    for block in range(used // block_m):  # each block serves one expert, and only its pairs
        members = pairs[block * block_m : (block + 1) * block_m]
        members = members[members < flat.numel()]
        assert (flat[members.long()] == block_experts[block]).all()
    assert set(block_experts[: used // block_m].tolist()) == set(flat[here].tolist())  # starved: no block


# Qwen3-MoE under -m slow (~11 s on the interpreter): the kernels are Mixtral's, and its greedy tokens
# on the torch path are tests/models/test_llama_equivalence.py's.
@pytest.mark.parametrize("arch", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "mixtral"])
def test_moe_models_on_the_triton_kernels_write_transformers_greedy_tokens(arch, hf_model_dirs, monkeypatch):
    """The whole MoE model on the Triton set (on a GPU: with CUDA graphs, which the fused kernel allows)."""
    from tests.models.test_llama_equivalence import hf_greedy
    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "triton")
    path, hf_model = hf_model_dirs[arch]
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=4)
    assert llm.engine.runner.model.graph_safe
    prompts = [[5, 17, 33, 2, 9, 11, 400], [7, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in prompts]


# Those pairs' gate/up rows are never written, and SiLU over whatever the buffer held may overflow in
# the interpreter; nothing reads the result (the output is checked below).
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_of_no_expert_here_add_nothing(dtype) -> None:
    """Expert parallelism hands the kernels other ranks' experts as id E: those pairs contribute zero,
    as if their routing weight were zero."""
    gen = torch.Generator().manual_seed(5)
    tokens, num_experts, top_k, hidden, inter = 23, 4, 3, 40, 24
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    experts, weights = routing(tokens, num_experts, top_k, dtype, gen)
    elsewhere = torch.rand(tokens, top_k, generator=gen).to(DEVICE) < 0.4
    zeroed = weights.masked_fill(elsewhere, 0)
    want = reference.fused_moe(x, w13, w2, experts, zeroed)
    marked = experts.masked_fill(elsewhere, num_experts)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, marked, zeroed), want, **tol)
    torch.testing.assert_close(fused_moe.fused_moe(x, w13, w2, marked, zeroed), want, **tol)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"), [(1, 3, 1), (7, 8, 2), (33, 60, 4), (19, 128, 8)]
)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_reference(tokens, num_experts, top_k, renormalize, dtype) -> None:
    gen = torch.Generator().manual_seed(num_experts)
    # Logits spaced apart, so no two experts tie after rounding to bf16 and the picks must match.
    logits = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(tokens)]) * 0.25
    logits = logits.to(DEVICE, dtype)
    experts, weights = fused_moe.topk_softmax(logits, top_k, renormalize)
    want_experts, want_weights = reference.topk_softmax(logits, top_k, renormalize)
    assert experts.dtype == want_experts.dtype and weights.dtype == want_weights.dtype == dtype
    assert torch.equal(experts, want_experts)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(weights, want_weights, **tol)
