"""Piecewise CUDA graphs: steps with prompt tokens replay the model between attention layers and attend
eagerly in between. Every replayed step is checked against the eager forward on the same inputs."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import ARCHS
from tokenmill import LLM, SamplingParams
from tokenmill.worker.piecewise_graphs import piecewise_sizes


def test_buckets_cover_every_step_size() -> None:
    for largest in (8, 100, 2048, 3000, 8192):
        sizes = piecewise_sizes(largest)
        assert sizes == sorted(set(sizes)) and sizes[-1] == largest and sizes[0] >= 1
    assert piecewise_sizes(8192)[:5] == [16, 32, 64, 128, 192]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_steps_equal_the_eager_forward(arch, hf_model_dirs, monkeypatch):
    path, _ = hf_model_dirs[arch]
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_batched_tokens=48,  # long prompts arrive in chunks beside other requests' decodes
        kv_cache_memory=256 << 20,
    )
    runner = llm.engine.runner
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.sizes[-1] == 48
    replay = graphs.run
    checked = []

    def run_and_compare(input_ids, positions, md):
        got = replay(input_ids, positions, md).clone()
        # The eager forward rewrites this step's K/V with its own values and attends the same way.
        want = runner.model(input_ids, positions, md)
        scale = want.float().abs().max()
        checked.append(((got.float() - want.float()).abs().max() / scale).item())
        return got

    monkeypatch.setattr(graphs, "run", run_and_compare)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(n)] for n in (3, 40, 7, 90, 1, 25, 61)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (20, 5, 30, 8, 12, 3, 9)
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert len(checked) >= 5  # chunked prompts next to decodes: several replayed steps
    assert max(checked) < 0.02, checked  # bf16 rounding, with kernels picked for padded shapes
