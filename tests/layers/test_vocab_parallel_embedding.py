"""Vocab-parallel embedding and LM head: every rank loads the same full table; the shards must rebuild it
(padded with zero rows to a multiple of padding_size per rank), the ranks' embeddings sum to the full
lookup, and their logits concatenate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size

TP_SIZES = [1, 2, 4]
# (vocab_size, padding_size, padded): a vocab a few ids short of a padding multiple, the default padding
# on a real-model-like odd vocab, and a vocab so small that the last ranks hold padding only.
VOCABS = [(37, 8, 40), (1003, 64, 1024), (5, 64, 64)]
DIM = 11


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def load(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    param = getattr(module, name)
    param.weight_loader(param, tensor)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("vocab_size, padding_size, padded", VOCABS)
def test_embedding_rows_split_over_the_padded_vocab(
    tp_size: int, vocab_size: int, padding_size: int, padded: int
) -> None:
    assert pad_vocab_size(vocab_size, padding_size) == padded
    padded = pad_vocab_size(vocab_size, padding_size * tp_size)
    table = randn(vocab_size, DIM, seed=1)
    ranks = [
        VocabParallelEmbedding(vocab_size, DIM, padding_size=padding_size, tp_size=tp_size, tp_rank=r)
        for r in range(tp_size)
    ]
    for layer in ranks:
        layer.weight.data.fill_(float("nan"))  # padding rows must be written, not left as they were
        load(layer, "weight", table)
        assert layer.weight.shape == (padded // tp_size, DIM)
    padded_table = torch.cat([table, torch.zeros(padded - vocab_size, DIM)])
    torch.testing.assert_close(torch.cat([layer.weight for layer in ranks]), padded_table, rtol=0, atol=0)
    # Every id, a repeat, and the first and last of each rank's range.
    input_ids = torch.cat([torch.arange(vocab_size), torch.tensor([vocab_size - 1, 0, vocab_size // 2])])
    outputs = [layer(input_ids) for layer in ranks]
    torch.testing.assert_close(sum(outputs), F.embedding(input_ids, table), rtol=0, atol=0)
    for layer, output in zip(ranks, outputs):
        mine = (input_ids >= layer.vocab_start_index) & (input_ids < layer.vocab_end_index)
        assert not output[~mine].any()  # other ranks' ids embed to zero here


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("bias", [False, True])
def test_lm_head_logits_concatenate_to_the_full_vocab(tp_size: int, bias: bool) -> None:
    vocab_size, padding_size = 37, 8
    table, vocab_bias, hidden = randn(vocab_size, 11, seed=1), randn(vocab_size, seed=2), randn(6, 11, seed=3)
    ranks = [
        ParallelLMHead(vocab_size, 11, bias=bias, padding_size=padding_size, tp_size=tp_size, tp_rank=r)
        for r in range(tp_size)
    ]
    for layer in ranks:
        load(layer, "weight", table)
        if bias:
            load(layer, "bias", vocab_bias)
    logits = torch.cat([layer(hidden) for layer in ranks], dim=-1)
    assert logits.shape == (6, pad_vocab_size(vocab_size, padding_size * tp_size))
    torch.testing.assert_close(logits[:, :vocab_size], F.linear(hidden, table, vocab_bias if bias else None))
    assert not logits[:, vocab_size:].any()  # padding columns: zero rows, zero bias


def test_tied_lm_head_shares_the_embedding_parameter() -> None:
    embed = VocabParallelEmbedding(37, 11, tp_size=2, tp_rank=1)
    lm_head = ParallelLMHead(37, 11, tp_size=2, tp_rank=1).tie_weights(embed)
    assert lm_head.weight is embed.weight
    load(embed, "weight", randn(37, 11, seed=1))
    hidden = randn(3, 11, seed=2)
    torch.testing.assert_close(lm_head(hidden), hidden @ embed.weight.T)


def test_a_table_of_another_vocab_size_is_refused() -> None:
    embed = VocabParallelEmbedding(1003, 11, tp_size=4, tp_rank=3)
    with pytest.raises(ValueError, match=r"shape \(1000, 11\) does not match the expected \(1003, 11\)"):
        load(embed, "weight", torch.zeros(1000, 11))
    # Any tp_size splits the vocab: it is padded to padding_size per rank.
    assert VocabParallelEmbedding(37, 11, padding_size=8, tp_size=3).num_embeddings_per_partition == 16
