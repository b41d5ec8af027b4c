"""The sliding window a Hugging Face config gives its layers, read one way by the engine
(serving/engine_setup.py caps max_model_len there: its attention is full-context) and by the planner
(plan/model_shape.py, on a config.json with transformers' defaults filled in). No torch here."""

from __future__ import annotations

# transformers' modeling of these slides every layer by sliding_window alone: it reads no
# use_sliding_window, max_window_layers or layer_types a config.json may carry (Qwen3-MoE's config
# clears sliding_window itself without use_sliding_window).
_EVERY_LAYER_SLIDES = ("mistral", "mixtral", "qwen3_moe")


def sliding_window(hf_config) -> int | None:
    """The window of the config's sliding-window layers, None where no layer slides: Mistral's,
    Mixtral's and Qwen3-MoE's sliding_window in every layer; Qwen2/Qwen3's only with
    use_sliding_window, and then only in the layers from max_window_layers on (transformers'
    layer_types says which, where the config has it)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if getattr(hf_config, "model_type", None) in _EVERY_LAYER_SLIDES:
        return window
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    first_sliding = getattr(hf_config, "max_window_layers", None)
    layers = getattr(hf_config, "num_hidden_layers", None)
    if first_sliding is not None and layers is not None and first_sliding >= layers:
        return None
    return window
