"""The context length the engine takes from a model's config: its positions, cut to a sliding window
only where some layer slides (attention here is full-context)."""

from __future__ import annotations

import pytest
import transformers

from tokenmill.config import EngineConfig
from tokenmill.serving.engine_setup import resolve_max_model_len


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (transformers.MistralConfig(max_position_embeddings=512, sliding_window=32), 32),
        (transformers.MistralConfig(max_position_embeddings=512, sliding_window=None), 512),
        # Qwen2/Qwen3: only with use_sliding_window, and only the layers from max_window_layers on slide.
        (
            transformers.Qwen2Config(
                max_position_embeddings=512, sliding_window=32, use_sliding_window=False
            ),
            512,
        ),
        (
            transformers.Qwen2Config(
                max_position_embeddings=512, sliding_window=32, use_sliding_window=True,
                num_hidden_layers=2, max_window_layers=2,
            ),
            512,
        ),
        (
            transformers.Qwen2Config(
                max_position_embeddings=512, sliding_window=32, use_sliding_window=True,
                num_hidden_layers=2, max_window_layers=1,
            ),
            32,
        ),
        # Mistral, Mixtral and Qwen3-MoE slide every layer whatever else the config.json carries.
        (
            transformers.MistralConfig(
                max_position_embeddings=512, sliding_window=32, use_sliding_window=False
            ),
            32,
        ),
        (transformers.MixtralConfig(max_position_embeddings=512, sliding_window=32), 32),
        (
            transformers.Qwen3MoeConfig(
                max_position_embeddings=512, sliding_window=32, use_sliding_window=True,
                num_hidden_layers=2, max_window_layers=2,
            ),
            32,
        ),
    ],
)  # fmt: skip
def test_a_sliding_window_caps_the_context_where_a_layer_slides(config, expected) -> None:
    assert resolve_max_model_len(EngineConfig(model="x"), config) == expected


def test_a_longer_context_than_the_window_names_it() -> None:
    config = transformers.MistralConfig(max_position_embeddings=512, sliding_window=32)
    with pytest.raises(ValueError, match="context length of 32 tokens .its sliding_window"):
        resolve_max_model_len(EngineConfig(model="x", max_model_len=64), config)
