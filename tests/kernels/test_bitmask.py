"""The Triton grammar masking against the torch form it replaces on CUDA (structured_outputs.apply_bitmask
on the CPU): the same -inf at the same places, for vocabularies that are not a multiple of 32 or of the
block, rows in any order, fp32 and bf16 logits, and a mask with fewer words than the vocabulary needs
(the tokens past it forbidden)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels.bitmask import apply_bitmask
from tokenmill.structured_outputs import apply_bitmask as apply_bitmask_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("num_rows", "vocab", "words", "dtype"),
    [
        (5, 77, 3, torch.float32),
        (3, 2048, 64, torch.bfloat16),  # exactly one block
        (9, 4099, 129, torch.float32),  # past a block by three tokens
        (4, 1001, 20, torch.bfloat16),  # the mask covers 640 of 1,001 tokens
    ],
)
def test_kernel_masks_as_the_torch_form(num_rows: int, vocab: int, words: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(vocab)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    rows = rng.permutation(num_rows)[: num_rows - 1].tolist()  # any order, one row left alone
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    expected = logits.clone()
    apply_bitmask_torch(expected, rows, bitmask)
    got = logits.to(DEVICE)
    apply_bitmask(got, torch.tensor(rows, device=DEVICE), torch.from_numpy(bitmask).to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert torch.isinf(expected).any() and torch.isfinite(expected).any()
    if words * 32 < vocab:  # the tokens past the mask are forbidden in every masked row
        assert torch.isneginf(expected[rows, words * 32 :]).all()
