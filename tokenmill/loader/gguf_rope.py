"""A GGUF model's rope scaling as Hugging Face's rope_parameters: Llama 3's recovered from the
per-frequency factors llama.cpp's converter stores (rope_freqs), linear and yarn from the rope.scaling
keys."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from tokenmill.loader.gguf_file import GGUFFile

# Llama 3 rope frequency factors, precomputed by the converter: folded into config.rope_parameters.
ROPE_FREQS = "rope_freqs.weight"


def rope_parameters(file: GGUFFile, head_dim: int) -> dict[str, Any]:
    """The Hugging Face rope_parameters of the file: Llama 3's from its rope_freqs factors, else linear or
    yarn from the rope.scaling keys, else the default rope."""
    rope_theta = float(file.arch_get("rope.freq_base", 10000.0))
    rope_freqs = file.tensors.get(ROPE_FREQS)
    if rope_freqs is not None:
        factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64)
        return _llama3_rope_parameters(file, factors, rope_theta, head_dim)
    scaling_type = file.arch_get("rope.scaling.type", "none")
    factor = file.arch_get("rope.scaling.factor", None)
    linear_scale = file.arch_get("rope.scale_linear", None)  # the key older files use
    if scaling_type == "none" and linear_scale is not None:
        scaling_type, factor = "linear", linear_scale
    if scaling_type == "none" or factor is None or factor == 1.0:
        return {"rope_type": "default", "rope_theta": rope_theta}
    if scaling_type == "linear":
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": float(factor)}
    if scaling_type != "yarn":
        raise file.error(f"rope scaling type {scaling_type!r} is unsupported (supported: linear, yarn).")
    parameters: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": rope_theta,
        "factor": float(factor),
        "original_max_position_embeddings": file.arch_get("rope.scaling.original_context_length"),
    }
    # The names llama.cpp's converter writes these Hugging Face fields under.
    for gguf_key, hf_key in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        value = file.arch_get(f"rope.scaling.{gguf_key}", None)
        if value is not None:
            parameters[hf_key] = float(value)
    return parameters


def _llama3_rope_parameters(
    file: GGUFFile, factors: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any]:
    """Recover Llama 3 rope scaling from the per-frequency factors llama.cpp stores in rope_freqs.

    Between the high- and low-frequency cut-offs the factors follow
    smooth = (old_context_len / wavelen - low) / (high - low), which depends only on the ratios of
    old_context_len, low and high: fixing low_freq_factor at Meta's 1.0 loses nothing, and a line fit
    over that band gives the other two. The result is checked against the stored factors."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    band = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    unsupported = file.error("rope_freqs.weight does not follow Llama 3 rope scaling.")
    if factors.shape != inv_freq.shape or factor <= 1.0 or band.sum() < 2:
        raise unsupported
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[band], smooth, 1)  # smooth = slope / wavelen + intercept
    high_freq_factor = float(f"{1.0 - 1.0 / intercept:.6g}")
    parameters = {
        "rope_type": "llama3",
        "rope_theta": rope_theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": round(slope * (high_freq_factor - 1.0)),
    }
    if not np.allclose(_llama3_rope_factors(parameters, head_dim), factors, rtol=1e-5, atol=0.0):
        raise unsupported
    return parameters


def _llama3_rope_factors(rope_parameters: dict[str, Any], head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for these Llama 3 rope parameters: the factor
    each rotary frequency is divided by."""
    inv_freq = 1.0 / rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old_context_len = rope_parameters["original_max_position_embeddings"]
    low, high = rope_parameters["low_freq_factor"], rope_parameters["high_freq_factor"]
    factor = rope_parameters["factor"]
    smooth = (old_context_len / wavelen - low) / (high - low)
    band_factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(
        wavelen < old_context_len / high, 1.0, np.where(wavelen > old_context_len / low, factor, band_factors)
    )
