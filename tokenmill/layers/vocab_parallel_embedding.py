"""The token embedding and the LM head, split over the vocabulary (vLLM's names and sharding): the vocab is
padded to a multiple of padding_size * tp_size, then cut into tp_size equal ranges of rows, one per rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import distributed
from tokenmill.layers.cpu_packed import packed_linear
from tokenmill.layers.dense import dense_linear
from tokenmill.layers.sharding import ShardId, check_dtype, divide

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return -(-vocab_size // padding_size) * padding_size


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * num_embeddings_per_partition, (r + 1) * num_embeddings_per_partition) of
    the padded table. Ids outside its range (other ranks' ids) embed to zero, so the ranks' outputs sum
    (an all-reduce over the tensor-parallel group) to every id's row. Padding rows load as zeros."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp_size = distributed.tp_size() if tp_size is None else tp_size
        tp_rank = distributed.tp_rank() if tp_rank is None else tp_rank
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1} (tp_size {tp_size}).")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # Padded to padding_size per rank, so that any tp_size splits it.
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * tp_size)
        self.num_embeddings_per_partition = divide(
            self.num_embeddings_padded, tp_size, "the padded vocab size"
        )
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        # A rank past the real vocab holds padding only: its range of real ids is empty.
        self.vocab_end_index = max(
            self.vocab_start_index,
            min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings),
        )
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
        self.weight.output_dim, self.weight.weight_loader = 0, self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's rows of the full [num_embeddings, ...] checkpoint tensor; zero the padding."""
        expected = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shape {tuple(loaded_weight.shape)} does not match the expected {expected}")
        check_dtype(param.dtype, loaded_weight)
        num_rows = self.vocab_end_index - self.vocab_start_index
        param.data[:num_rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        embeddings = F.embedding((input_ids - self.vocab_start_index) * in_range, self.weight)
        return distributed.all_reduce(embeddings.masked_fill_(~in_range.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding: rank r computes the logits of its vocab range.
    forward returns [num_tokens, num_embeddings_padded], the ranks' shards gathered, padding columns
    included; the caller keeps the first num_embeddings columns."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        *,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_size=padding_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            params_dtype=params_dtype,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=params_dtype), requires_grad=False
            )
            self.bias.output_dim, self.bias.weight_loader = 0, self.weight_loader
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's table (tie_word_embeddings): one parameter, loaded once."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_weight", None)  # set on a CPU in bf16 (layers/cpu_packed.py)
        if packed is not None:
            logits = packed_linear(hidden, packed, self.bias)
        else:
            logits = dense_linear(hidden, self.weight, self.bias)
        return distributed.all_gather(logits, dim=-1)
