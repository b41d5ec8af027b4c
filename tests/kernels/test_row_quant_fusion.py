"""The W8A8 linears' input quantized in the launch that makes it (the RMSNorm's and the gated
activation's: layers/fused_linear.py's row_quant_for) against the linears quantizing it in a launch of
their own: the same bits, so the same log-probabilities, with fewer quantizing launches."""

from __future__ import annotations

import gc
import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import BACKEND_ENV
from tokenmill.layers import fused_linear
from tokenmill.layers.quantization import fp8, fp8_block

# The Triton variant on the CPU's interpreter takes ~14 s a test; its kernels' bits are
# tests/kernels/test_norm.py's and test_activation.py's, and the torch variant runs the same wiring: -m slow
# (the GPU calls run every test of the file).
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.slow)]


def _run(path: str, fused: bool, monkeypatch, quantization: str | None = "fp8") -> tuple[list, int]:
    """Greedy tokens with their top log-probabilities, and how many times an FP8 linear quantized its
    own input."""
    calls = 0
    quantize = fp8.quantize_per_row

    def counted(x, static_scale=None):
        nonlocal calls
        calls += 1
        return quantize(x, static_scale)

    monkeypatch.setattr(fused_linear, "ROW_QUANT_FUSION", fused)
    # The references run on the CPU (on a GPU they are not captured into CUDA graphs); a small KV cache,
    # so that the two engines of a test fit one GPU; eager, since a graph's replay (prompt steps' too, in
    # pieces) calls no Python, so nothing would count.
    on_cpu = {"device": "cpu"} if os.environ.get(BACKEND_ENV) == "torch" else {}
    llm = LLM(
        path, skip_tokenizer_init=True, dtype="bfloat16", quantization=quantization, max_model_len=128,
        num_kv_blocks=16, enforce_eager=True, **on_cpu,
    )  # fmt: skip
    monkeypatch.setattr(fp8, "quantize_per_row", counted)
    monkeypatch.setattr(fp8_block, "quantize_per_row", counted)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    # A prefill of more rows than a GPU's one-row kernels take (kernels.SKINNY_MAX_ROWS), which multiply
    # the 16-bit rows as they are; the decode steps after it are such.
    prompts = [[1 + (7 * i) % 900 for i in range(14)], [2 + (11 * i) % 900 for i in range(9)]]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    monkeypatch.setattr(fp8, "quantize_per_row", quantize)
    monkeypatch.setattr(fp8_block, "quantize_per_row", quantize)
    got = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outputs]
    del llm, outputs
    gc.collect()  # the engine's GPU memory back before the next one
    return got, calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_quantization_gives_the_separate_launches_log_probabilities(
    backend: str, hf_model_dirs, monkeypatch
) -> None:
    """Qwen3 (q/k norms after the QKV projection) on the torch references (the norm, then the method's
    own quantizer) and on the Triton kernels (one launch: kernels/norm.py's and activation.py's)."""
    if backend == "triton":
        pytest.importorskip("triton")  # without a GPU: the interpreter (tests/kernels/conftest.py)
    monkeypatch.setenv(BACKEND_ENV, backend)
    path = hf_model_dirs["qwen3"][0]
    fused, fused_calls = _run(path, True, monkeypatch)
    separate, separate_calls = _run(path, False, monkeypatch)
    assert fused == separate
    if backend == "triton":  # only o_proj quantizes its own input: 1 of a layer's 4 W8A8 linears
        assert separate_calls == 4 * fused_calls > 0
    else:  # the references quantize with the method's own function either way
        assert separate_calls == fused_calls > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_quantization_by_groups_gives_the_separate_launches_log_probabilities(
    backend: str, tmp_path, monkeypatch
) -> None:
    """A fine-grained FP8 checkpoint (blocks of 32, as Qwen3-FP8's of 128), whose activations are
    quantized per token and per group of 32 columns."""
    from tests.layers.test_fp8_block import make_checkpoint

    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv(BACKEND_ENV, backend)
    make_checkpoint("llama", tmp_path)
    fused, fused_calls = _run(str(tmp_path), True, monkeypatch, quantization=None)
    separate, separate_calls = _run(str(tmp_path), False, monkeypatch, quantization=None)
    assert fused == separate
    if backend == "triton":
        assert separate_calls == 4 * fused_calls > 0
    else:
        assert separate_calls == fused_calls > 0
