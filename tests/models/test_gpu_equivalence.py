"""On a GPU, in bf16: the Triton kernels and CUDA graphs end to end against transformers. Greedy tokens
must be transformers' fp32 argmax, or within bf16 rounding of it where the top two nearly tie."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import ARCHS
from tests.models.test_llama_equivalence import PROMPTS
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEAR_TIE = 0.04  # of the largest logit: bf16 keeps about 3 significant digits through each layer


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("enforce_eager", "decode_rotary"),
    # The decode attention doing the rotary and the K/V store itself (layers/attention.py DECODE_ROTARY),
    # in the graphs and eager.
    [(False, False), (True, False), (False, True), (True, True)],
)
def test_greedy_tokens_match_transformers_in_bf16(
    arch, enforce_eager, decode_rotary, hf_model_dirs, monkeypatch
):
    from tokenmill.layers import attention as attention_layer

    monkeypatch.setattr(attention_layer, "DECODE_ROTARY", decode_rotary)
    path, hf_model = hf_model_dirs[arch]
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        block_size=16,
        enforce_eager=enforce_eager,
        kv_cache_memory=256 << 20,
    )
    if not enforce_eager:
        assert llm.engine.runner.decode_graphs is not None
        assert llm.engine.runner.piecewise_graphs is not None  # the batched prefill replays them
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    # One prompt alone takes the dense (cuDNN) prefill path: judged the same way below.
    outputs += llm.generate(prompt_token_ids=PROMPTS[2:3], sampling_params=params, use_tqdm=False)
    model = copy.deepcopy(hf_model).to("cuda")  # fp32: the model's true greedy choice
    for prompt, output in zip(PROMPTS + PROMPTS[2:3], outputs):
        tokens = output.outputs[0].token_ids
        sequence = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=-1).values - chosen
        # Teacher-forced on our own tokens: each pick is transformers' argmax or within a near tie.
        tolerance = NEAR_TIE * logits.abs().max(dim=-1).values
        assert (gap <= tolerance).all(), f"{arch}: gaps {gap.tolist()} tolerance {tolerance.tolist()}"
        assert (gap == 0).float().mean() >= 0.75  # the rest are the near ties bounded above


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_embeddings_match_transformers_in_bf16(pooling, hf_model_dirs):
    path, hf_model = hf_model_dirs["qwen3"]
    llm = LLM(
        model=path,
        runner="pooling",
        pooling_type=pooling,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_batched_tokens=64,  # the longer prompts are pooled over several chunks
        kv_cache_memory=256 << 20,
    )
    outputs = llm.embed(prompt_token_ids=PROMPTS, use_tqdm=False)
    outputs += llm.embed(prompt_token_ids=PROMPTS[2:3], use_tqdm=False)  # alone: the dense prefill path
    base = copy.deepcopy(hf_model.model).to("cuda")
    for prompt, output in zip(PROMPTS + PROMPTS[2:3], outputs):
        with torch.no_grad():
            hidden = base(torch.tensor([prompt], device="cuda")).last_hidden_state[0].float()
        want = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)
        got = torch.tensor(output.outputs.embedding, device="cuda")
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
