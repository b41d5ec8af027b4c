"""apply_bitmask: -inf exactly where a row's grammar bitmask has a 0 bit, only at the given logit rows,
for vocabularies that are not a multiple of 32; on a GPU the same as on the CPU, from host arrays or from
tensors already on the device (as the model runner stages them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.structured_outputs import apply_bitmask


def reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for mask_row, row in enumerate(rows):
        for token in range(vocab):
            word = int(bitmask[mask_row, token // 32]) if token // 32 < bitmask.shape[1] else 0
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(("num_rows", "vocab", "words"), [(5, 77, 3), (3, 32, 1), (9, 1001, 32), (4, 100, 3)])
def test_masks_only_the_forbidden_tokens_of_the_given_rows(num_rows: int, vocab: int, words: int) -> None:
    """(4, 100, 3): logits wider than the mask's words, whose tokens past them are forbidden."""
    rng = np.random.default_rng(vocab)
    logits = torch.randn(num_rows, vocab)
    rows = sorted(rng.choice(num_rows, size=num_rows - 1, replace=False).tolist())[::-1]  # any order
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)
    expected = reference(logits, rows, bitmask)
    apply_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("vocab", [49152, 151_937])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_same_as_on_the_cpu(vocab: int) -> None:
    rng = np.random.default_rng(0)
    cpu = torch.randn(64, vocab)
    rows = rng.permutation(64)[:40].tolist()
    bitmask = rng.integers(-(2**31), 2**31, size=(40, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    gpu, staged = cpu.cuda(), cpu.cuda()
    apply_bitmask(cpu, rows, bitmask)
    apply_bitmask(gpu, rows, bitmask)
    # As the model runner hands them over: rows and mask already on the device.
    on_device = torch.tensor(rows, device="cuda"), torch.from_numpy(bitmask).cuda()
    apply_bitmask(staged, *on_device)
    apply_bitmask(staged, *on_device)  # masking twice changes nothing more
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu) and torch.equal(staged.cpu(), cpu)
