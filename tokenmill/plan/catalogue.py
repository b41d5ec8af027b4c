"""Named model shapes (public Hugging Face config.json values) and the resolution of `--model` to a shape:
a catalogue name, `default`, a model directory, a config.json or a GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.plan.model_shape import ModelShape, load_gguf, load_hf_dir

MODELS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(  # meta-llama/Llama-3.1-8B
            name="llama-3.1-8b",
            hidden_size=4096,
            num_layers=32,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        ModelShape(  # meta-llama/Llama-3.1-70B
            name="llama-3.1-70b",
            hidden_size=8192,
            num_layers=80,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        ModelShape(  # Qwen/Qwen3-0.6B
            name="qwen3-0.6b",
            hidden_size=1024,
            num_layers=28,
            num_attention_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=40960,
        ),
        ModelShape(  # Qwen/Qwen3-8B
            name="qwen3-8b",
            hidden_size=4096,
            num_layers=36,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            qk_norm=True,
            max_position_embeddings=40960,
        ),
        ModelShape(  # Qwen/Qwen3-30B-A3B: every layer is MoE, so intermediate_size (6144) is unused
            name="qwen3-30b-a3b",
            hidden_size=2048,
            num_layers=48,
            num_attention_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=6144,
            vocab_size=151936,
            qk_norm=True,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            max_position_embeddings=40960,
        ),
        ModelShape(  # mistralai/Mixtral-8x7B-v0.1
            name="mixtral-8x7b",
            hidden_size=4096,
            num_layers=32,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=32000,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=14336,
            max_position_embeddings=32768,
        ),
        ModelShape(  # deepseek-ai/DeepSeek-V3 without its multi-token-prediction layer
            name="deepseek-v3",
            hidden_size=7168,
            num_layers=61,
            num_attention_heads=128,
            num_kv_heads=128,
            head_dim=192,
            intermediate_size=18432,
            vocab_size=129280,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=2048,
            shared_expert_intermediate_size=2048,
            moe_dense_layers=3,
            router_bias=True,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            max_position_embeddings=163840,
        ),
        ModelShape(  # HuggingFaceTB/SmolLM2-135M-Instruct, the embedded default
            name="smollm2-135m",
            hidden_size=576,
            num_layers=30,
            num_attention_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    )
}

# Suffixes a hub id carries that do not change the shape (Llama-3.1-8B-Instruct is Llama-3.1-8B).
_SHAPE_NEUTRAL_SUFFIXES = ("-instruct", "-chat", "-base", "-fp8", "-v0.1", "-2507")


def catalogue_key(name: str) -> str:
    """Map a catalogue name or a hub id (`meta-llama/Llama-3.1-8B-Instruct`) to a catalogue key."""
    key = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    stripped = True
    while stripped:
        stripped = False
        for suffix in _SHAPE_NEUTRAL_SUFFIXES:
            if key.endswith(suffix):
                key, stripped = key.removesuffix(suffix), True
    return key


def default_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF (the engine's own lookup; it imports no torch)."""
    from tokenmill.loader.default_model import default_model_path

    return Path(default_model_path())


def resolve_model(spec: str) -> ModelShape:
    if spec == "default":
        return load_gguf(default_gguf_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return load_hf_dir(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return load_gguf(path)
        if path.suffix == ".json":
            return load_hf_dir(path)
        raise ValueError(f"cannot read model file {path}: expected a .gguf file or a config.json")
    # A path that is not there is an error even when it ends in a catalogue name (/models/Llama-3.1-8B).
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or path.suffix in (".gguf", ".json"):
        raise ValueError(f"cannot read model {path}: no such file or directory")
    key = catalogue_key(spec)
    if key in MODELS:
        return MODELS[key]
    if "/" in spec:
        raise ValueError(
            f"unknown model {spec!r}: a hub id the catalogue does not name, and the planner does not "
            "download; pass the directory or the config.json of a local copy"
        )
    raise ValueError(
        f"unknown model {spec!r}: not a catalogue name ({', '.join(MODELS)}), 'default', "
        "a directory with config.json, or a .gguf file"
    )


def checkpoint_weight_dtype(spec: str) -> str | None:
    """The planner's --weight-dtype for a quantized checkpoint (a model directory or its config.json):
    from config.json's quantization_config, or the file beside it that AutoGPTQ, AutoAWQ or Model
    Optimizer wrote; None for anything else (a catalogue name, an unquantized or GGUF model, a scheme the
    planner has no dtype for)."""
    path = Path(spec).expanduser()
    directory = path if path.is_dir() else path.parent if path.suffix == ".json" else None
    if directory is None or not (directory / "config.json").is_file():
        return None
    from tokenmill.loader.hf import quantization_config_beside

    try:
        raw = json.loads((directory / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    raw = raw if isinstance(raw, dict) else quantization_config_beside(str(directory))
    return _weight_dtype(raw) if isinstance(raw, dict) else None


def _weight_dtype(raw: dict) -> str | None:
    method = raw.get("quant_method")
    if method in ("gptq", "awq"):
        bits = raw.get("bits", raw.get("w_bit", 4))
        return {4: "int4", 8: "int8"}.get(bits)
    if method == "fp8":
        return "fp8"
    nested = raw.get("quantization")
    algo = (nested if isinstance(nested, dict) else raw).get("quant_algo")
    if isinstance(algo, str):  # Model Optimizer
        return "fp8" if algo.upper().startswith("FP8") else None
    if method == "compressed-tensors":
        groups = [g for g in (raw.get("config_groups") or {}).values() if isinstance(g, dict)]
        weights = [g.get("weights") or {} for g in groups]
        kinds = {(w.get("type", "int"), w.get("num_bits")) for w in weights}
        if len(kinds) == 1:
            return {("int", 4): "int4", ("int", 8): "int8", ("float", 8): "fp8"}.get(kinds.pop())
    return None
