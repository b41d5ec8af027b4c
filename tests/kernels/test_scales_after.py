"""A W8A8 FP8 linear's scales left to the launch after it (layers/quantization/fp8.py SCALES_AFTER,
kernels.ScaledRows): the RMSNorm and the gated activation given the unscaled product and its per-row and
per-column scales write what they write from the scaled output (ScaledRows.resolve) bit for bit, the
references too; fp8_linear hands the product over only where it may; and a model with the switch on
writes the greedy tokens and log-probabilities it writes with it off."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels import (  # noqa: E402
    BACKEND_ENV,
    FP8_GEMM_MAX_ROWS,
    RowQuant,
    ScaledRows,
    activation,
    norm,
    reference,
)
from tokenmill.kernels.fp8_quant import quantize_fp8_per_row  # noqa: E402
from tokenmill.layers.quantization import fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def scaled_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> ScaledRows:
    """An unscaled product as cuBLAS leaves it (bf16 sums of e4m3 products, hundreds to thousands), the
    activations' per-row scales and the weight's per-column ones (small, as FP8 scales are)."""
    gen = torch.Generator().manual_seed(seed)
    values = (2000 * torch.randn(shape, generator=gen)).to(DEVICE, torch.bfloat16)
    row_scale = (torch.rand(*shape[:-1], 1, generator=gen) * 1e-2 + 1e-3).to(DEVICE)
    col_scale = (torch.rand(shape[-1], generator=gen) * 1e-2 + 1e-3).to(DEVICE)
    return ScaledRows(values, row_scale, col_scale, dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (
        torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        if got.element_size() == 1
        else torch.equal(got, want)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 100), (2, 3, 48)])
def test_norms_apply_the_scales_as_they_load(shape, dtype) -> None:
    """rms_norm, the residual add and the quantizing norm over ScaledRows against the same launches over
    the scaled output; the torch references likewise."""
    x = scaled_rows(shape, dtype, 0)
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=gen).to(DEVICE, dtype)
    plain = x.resolve()
    same(norm.rms_norm(x, weight, EPS), norm.rms_norm(plain, weight, EPS))
    for got, want in zip(
        norm.fused_add_rms_norm(x, residual, weight, EPS),
        norm.fused_add_rms_norm(plain, residual, weight, EPS),
    ):
        same(got, want)
    quant = RowQuant(False, None, quantize_fp8_per_row)
    got, got_residual = norm.rms_norm_quant(x, residual, weight, EPS, quant)
    want, want_residual = norm.rms_norm_quant(plain, residual, weight, EPS, quant)
    same(got.values, want.values), same(got.scale, want.scale), same(got_residual, want_residual)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    for got, want in zip(
        reference.fused_add_rms_norm(x, residual, weight, EPS),
        reference.fused_add_rms_norm(plain, residual, weight, EPS),
    ):
        same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("intermediate", [100, 1040])
def test_gated_activation_applies_the_scales_as_it_loads(intermediate, dtype) -> None:
    """silu(gate) * up, and the same quantized for the down projection, over ScaledRows of gate || up
    (each half with its own columns' scales) against the scaled output; the reference likewise."""
    x = scaled_rows((5, 2 * intermediate), dtype, 2)
    plain = x.resolve()
    same(activation.silu_and_mul(x), activation.silu_and_mul(plain))
    quant = RowQuant(False, None, quantize_fp8_per_row)
    got, want = activation.silu_and_mul_quant(x, quant), activation.silu_and_mul_quant(plain, quant)
    same(got.values, want.values), same(got.scale, want.scale)
    assert got.dtype == want.dtype == dtype
    same(reference.silu_and_mul(x), reference.silu_and_mul(plain))


def _linear_inputs(rows: int, k: int = 96, n: int = 48):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=gen)
    w_scale = w.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
    w_q = (w / w_scale).to(fp8.FP8_DTYPE)
    return x, w_q.to(DEVICE), w_scale.to(DEVICE)


def test_fp8_linear_leaves_its_scales_only_where_it_may(monkeypatch) -> None:
    """At SCALES_AFTER_MIN_ROWS (past FP8_GEMM_MAX_ROWS unless set) to _MAX_ROWS rows, with the switch on,
    asked by its caller and without a bias, the product comes unscaled; its resolve() is the scaled
    product (to the rounding of the order in which the scales are applied). Elsewhere a tensor."""
    rows = FP8_GEMM_MAX_ROWS + 9
    x, w_q, w_scale = _linear_inputs(rows)
    monkeypatch.setattr(fp8, "SCALES_AFTER", True)
    got = fp8.fp8_linear(x, w_q, w_scale, None, scales_after=True)
    assert isinstance(got, ScaledRows) and got.values.shape == (rows, 48) and got.dtype == torch.bfloat16
    assert got.row_scale.shape == (rows, 1) and got.col_scale.shape == (48,)
    want = fp8.fp8_linear(x, w_q, w_scale, None)
    torch.testing.assert_close(got.resolve(), want, rtol=1.6e-2, atol=1e-3)
    bias = torch.ones(48, device=DEVICE, dtype=torch.bfloat16)
    assert isinstance(fp8.fp8_linear(x, w_q, w_scale, bias, scales_after=True), torch.Tensor)
    assert isinstance(
        fp8.fp8_linear(x[:FP8_GEMM_MAX_ROWS], w_q, w_scale, None, scales_after=True), torch.Tensor
    )
    assert isinstance(fp8.fp8_linear(x, w_q, w_scale, None), torch.Tensor)
    monkeypatch.setattr(fp8, "SCALES_AFTER_MAX_ROWS", rows - 1)
    assert isinstance(fp8.fp8_linear(x, w_q, w_scale, None, scales_after=True), torch.Tensor)
    monkeypatch.setattr(fp8, "SCALES_AFTER_MAX_ROWS", rows)
    assert isinstance(fp8.fp8_linear(x, w_q, w_scale, None, scales_after=True), ScaledRows)
    monkeypatch.setattr(fp8, "SCALES_AFTER_MIN_ROWS", 17)  # the Triton FP8 GEMM's sizes too
    assert isinstance(fp8.fp8_linear(x[:17], w_q, w_scale, None, scales_after=True), ScaledRows)
    assert isinstance(fp8.fp8_linear(x[:16], w_q, w_scale, None, scales_after=True), torch.Tensor)
    monkeypatch.setattr(fp8, "SCALES_AFTER", False)
    assert isinstance(fp8.fp8_linear(x, w_q, w_scale, None, scales_after=True), torch.Tensor)


def test_a_static_input_scale_is_spread_over_the_rows(monkeypatch) -> None:
    """A checkpoint's per-tensor activation scale (compressed-tensors' static scheme): one scale for
    every row of the ScaledRows."""
    rows = FP8_GEMM_MAX_ROWS + 3
    x, w_q, w_scale = _linear_inputs(rows)
    monkeypatch.setattr(fp8, "SCALES_AFTER", True)
    static = torch.tensor([0.02], device=DEVICE)
    got = fp8.fp8_linear(x, w_q, w_scale, None, static, scales_after=True)
    assert isinstance(got, ScaledRows) and got.row_scale.shape == (rows, 1)
    torch.testing.assert_close(
        got.resolve(), fp8.fp8_linear(x, w_q, w_scale, None, static), rtol=1.6e-2, atol=1e-3
    )


def _generate(path: str, scales_after: bool, monkeypatch) -> tuple[list, int]:
    """Greedy tokens with their top log-probabilities of online FP8 over a prompt of more rows than
    FP8_GEMM_MAX_ROWS, and how many products were handed on unscaled."""
    monkeypatch.setattr(fp8, "SCALES_AFTER", scales_after)
    handed = 0
    unscaled = fp8._unscaled_product

    def counted(*args):
        nonlocal handed
        handed += 1
        return unscaled(*args)

    monkeypatch.setattr(fp8, "_unscaled_product", counted)
    llm = LLM(
        path, skip_tokenizer_init=True, dtype="float32", quantization="fp8", max_model_len=160,
        num_kv_blocks=24, enforce_eager=True, device="cpu",
    )  # fmt: skip
    prompts = [[1 + (7 * i) % 200 for i in range(FP8_GEMM_MAX_ROWS + 20)], [3, 9, 27, 81]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    del llm, outputs
    gc.collect()
    return got, handed


# The Triton kernels on the CPU's interpreter take ~30 s a model (-m slow; the GPU calls run them).
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's: a GPU runs Triton"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_model_writes_the_same_with_the_scales_after(arch, backend, hf_model_dirs, monkeypatch) -> None:
    """Online FP8 on the CPU (the references, or the Triton norms and activation in the interpreter, which
    then also quantize for the next linear): with the switch on, each layer's O, gate/up and down products
    of the long prompt reach their norm or activation unscaled (3 a layer), and the greedy tokens and
    top log-probabilities are those with it off."""
    monkeypatch.setenv(BACKEND_ENV, backend)
    path = hf_model_dirs[arch][0]
    on, handed = _generate(path, True, monkeypatch)
    off, none_handed = _generate(path, False, monkeypatch)
    layers = 2  # tests/conftest.py's random models
    assert handed == 3 * layers and none_handed == 0
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    for (_, on_logprobs), (_, off_logprobs) in zip(on, off):
        for on_step, off_step in zip(on_logprobs, off_logprobs):
            assert on_step.keys() == off_step.keys()
            for token, value in on_step.items():
                assert abs(value.logprob - off_step[token].logprob) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_on_the_gpu_writes_the_same_with_the_scales_after(hf_model_dirs, monkeypatch) -> None:
    """On a GPU with FP8 tensor cores, through its CUDA graphs: cuBLAS's per-tensor GEMM at scales 1 and
    the Triton norms and activation applying the scales, against the row-wise GEMM; bf16, so the two
    round differently: the same greedy tokens, log-probabilities within 0.05."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    path = hf_model_dirs["llama"][0]
    results = {}
    for on in (True, False):
        monkeypatch.setattr(fp8, "SCALES_AFTER", on)
        llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", quantization="fp8", max_model_len=256)
        prompts = [[1 + (7 * i + j) % 200 for i in range(100 + 13 * j)] for j in range(3)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        del llm, outputs
        gc.collect()
    for (on_tokens, on_logprobs), (off_tokens, off_logprobs) in zip(results[True], results[False]):
        assert on_tokens == off_tokens
        for token, on_step, off_step in zip(on_tokens, on_logprobs, off_logprobs):
            assert abs(on_step[token].logprob - off_step[token].logprob) < 0.05
