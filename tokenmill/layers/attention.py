"""The attention layer: writes new K/V into its paged cache, then attends over each request's context.
The backend (Triton on CUDA, torch reference elsewhere) is chosen once, when the layer is built."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenmill.kernels import Kernels, StepRotary, get_kernels
from tokenmill.kernels.reference import FP8_DTYPE, as_stored_fp8
from tokenmill.layers.rotary import RotaryEmbedding

# Whether a decode step's attention rotates q and k and stores K/V in its own launch (paged_attention's
# `rotary`) instead of after the rotary-and-store launch: one launch a layer fewer. On by default since
# 2026-12-05: on the H200 the 8B batch-1 step through the public API took 0.7-1.1% less time (bf16 3.951
# -> 3.918 ms, FP8 2.418 -> 2.391, INT4 1.973 -> 1.959) and the greedy-token, attention-layer, speculative
# and decode-kernel tests passed with it (docs/performance.md). TOKENMILL_DECODE_ROTARY=0 turns it off.
DECODE_ROTARY = os.environ.get("TOKENMILL_DECODE_ROTARY", "1") != "0"

# Preference order for dense prefill; SDPA falls through to the next when one cannot run the shape.
_DENSE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def dense_bucket(num_tokens: int) -> int:
    """The length dense prefill runs at: cuDNN builds a plan per sequence length (70-80 ms for each new
    one on an H200), so lengths are rounded up to a few buckets, all of which start-up warms."""
    step = 256 if num_tokens <= 4096 else 1024
    return -(-num_tokens // step) * step


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence, q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. The sequence is
    padded at its end to its bucket: under a causal mask no real query sees the padding."""
    num_tokens = q.shape[0]
    pad = dense_bucket(num_tokens) - num_tokens
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    with sdpa_kernel(_DENSE_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[0].transpose(0, 1)[:num_tokens]


@dataclass
class AttentionMetadata:
    """Flat varlen batch description shared by every attention layer of one forward pass."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0  # requests with one query token (a decode, or a one-token prompt)
    # One request, whole prompt, no cached prefix: attention can read K/V straight from this step's
    # tensors through cuDNN's dense causal kernel, the fastest long prefill on Hopper.
    dense_prefill: bool = False


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: Kernels | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels or get_kernels()
        # With a rotary embedding, forward and attend take the positions and rotate q and k themselves,
        # in the launch that stores K/V. Held in a tuple: the owning attention block registers it.
        self.rotary = (rotary,) if rotary is not None else ()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-tensor scales of an FP8 KV cache (it holds K / k_scale and V / v_scale); 1 otherwise.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The checkpoint's own (compressed-tensors kv_cache_scheme), kept aside until the cache dtype is
        # known: an FP8 cache takes them (worker/model_loader.py's kv_cache_dtype), a bf16 one ignores them.
        self.stored_kv_scales: tuple[float, float] | None = None
        # Set only while piecewise CUDA graphs are captured (worker/piecewise_graphs.py): the call
        # ends the graph piece being captured instead of attending.
        self.split: Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = (
            None
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q, k, v of this step's tokens -> [T, H * D]. With a rotary embedding, q and k arrive unrotated
        and positions [T] must be given."""
        if self.split is not None:
            return self.split(self, q, k, v)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if attn_metadata.dense_prefill:
            q, k = self.store_kv(q, k, v, attn_metadata, positions)
            if self.k_cache.dtype == FP8_DTYPE:  # read as the paged kernels read what was just stored
                k, v = as_stored_fp8(k, self.k_scale), as_stored_fp8(v, self.v_scale)
            # reshape: the [T, H, D] view is contiguous from cuDNN (bf16/fp16), not from the fp32 backends.
            return dense_causal_attention(q, k, v, self.scale).reshape(
                num_tokens, self.num_heads * self.head_dim
            )
        return self.attend(q, k, v, attn_metadata, positions=positions).view(
            num_tokens, self.num_heads * self.head_dim
        )

    def store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V into the cache, rotating q and k first when this layer has a rotary
        embedding (one launch for both); returns (q, k) as attention reads them."""
        if self.rotary:
            if positions is None:
                raise ValueError("this attention layer applies rotary embeddings: pass the positions")
            return self.kernels.rotary_and_write_kv_cache(
                positions, q, k, v, self.rotary[0].cos_sin_cache, self.k_cache, self.v_cache,
                attn_metadata.slot_mapping, self.k_scale, self.v_scale,
            )  # fmt: skip
        self.kernels.write_kv_cache(
            k, v, self.k_cache, self.v_cache, attn_metadata.slot_mapping, self.k_scale, self.v_scale
        )
        return q, k

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache (see store_kv), then paged attention of q [T, H, D] over
        each request's context; into `out` when given. Returns [T, H, D]. A decode step (one query token
        a request) with a rotary embedding does both in the attention launch (DECODE_ROTARY)."""
        rotary = None
        if DECODE_ROTARY and self.rotary and positions is not None and attn_metadata.max_query_len == 1:
            rotary = StepRotary(positions, self.rotary[0].cos_sin_cache, k, v, attn_metadata.slot_mapping)
        else:
            q, _ = self.store_kv(q, k, v, attn_metadata, positions)
        return self.kernels.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            attn_metadata.block_tables,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.scale,
            out,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            num_decodes=attn_metadata.num_decodes,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            rotary=rotary,
        )
