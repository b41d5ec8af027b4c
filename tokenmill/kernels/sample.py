"""Sampling in one launch, for the rows most steps have: each row's greedy token (the first index of its
largest logit, as torch.argmax) and, at a temperature, a draw from softmax(logits / T) by the Gumbel-max
trick (argmax of logits / T + Gumbel noise), with the noise from Philox counters (tl.rand) keyed by a
seed the caller changes every launch. The sampler's torch form takes about ten launches for the same
(the fp32 copy, argmax, the temperature's division, softmax, exponential noise, a division, argmax, a
select), each a few tens of microseconds of the host loop; this takes one. Rows that need more (top-k/p,
min-p, penalties, a logit bias, a seeded generator, logprobs) stay on the torch form (worker/sampler.py).
The torch reference of the same signature is kernels/reference.py's sample_rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens a program reads at a time, looping over its row.
SAMPLE_BLOCK = 2048


@triton.jit(do_not_specialize=["seed"])
def _sample_kernel(
    logits, stride_logits, temperature, out, vocab, seed, HAS_TEMPERATURE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Program r: out[r] = row r's draw at temperature[r] > 0, else its greedy token. A row whose logits
    are all -inf gives token 0."""
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride_logits
    best = tl.full([], float("-inf"), tl.float32)
    best_token = tl.full([], 0, tl.int64)
    drawn = tl.full([], float("-inf"), tl.float32)
    drawn_token = tl.full([], 0, tl.int64)
    t = tl.full([], 0.0, tl.float32)
    if HAS_TEMPERATURE:
        t = tl.load(temperature + r)
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)  # a greedy row's draw is made at 1 and not taken
    for first in range(0, vocab, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        # Strictly greater: an earlier block keeps a tie, and argmax keeps the first index within one.
        block_best = tl.max(x, axis=0)
        if block_best > best:
            best = block_best
            best_token = first + tl.argmax(x, axis=0).to(tl.int64)
        if HAS_TEMPERATURE:
            u = tl.rand(seed, r * vocab + cols)  # [0, 1): u = 0 gives -inf noise, never drawn
            y = x * inv_t - tl.log(-tl.log(u))
            block_drawn = tl.max(y, axis=0)
            if block_drawn > drawn:
                drawn = block_drawn
                drawn_token = first + tl.argmax(y, axis=0).to(tl.int64)
    tl.store(out + r, tl.where(t > 0, drawn_token, best_token))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor | None, seed: int) -> torch.Tensor:
    """One token per row of logits [B, V] (fp32, bf16 or fp16; rows may be a strided slice), int64 [B]:
    where temperature [B] (fp32) is > 0, a draw from softmax(row / temperature), else (or when
    temperature is None) the row's greedy token. seed: keys the noise; the same seed and logits give the
    same tokens, so the caller passes a new one every step."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if temperature is not None and temperature.stride(0) != 1:
        temperature = temperature.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
            logits, logits.stride(0), temperature if temperature is not None else logits, out, vocab,
            seed, HAS_TEMPERATURE=temperature is not None, BLOCK=SAMPLE_BLOCK, num_warps=8,
        )  # fmt: skip
    return out
