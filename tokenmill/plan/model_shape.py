"""The shape of a decoder-only transformer as the planner needs it, and its parameter counts, read from a
Hugging Face config.json or from a GGUF file's metadata (shapes only: no weight is loaded)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from tokenmill.attention_window import sliding_window


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # width of the dense MLP (the dense layers of a MoE model)
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts: num_experts routed experts per MoE layer, 0 for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # total width of the always-on shared experts
    moe_dense_layers: int = 0  # layers of a MoE model with a dense MLP (DeepSeek's first_k_dense_replace)
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_expert_gate: bool = False  # Qwen2-MoE scales its shared expert by a learned gate
    # Multi-head latent attention (DeepSeek): the KV cache holds kv_lora_rank + qk_rope_head_dim per token.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 0
    # Where some layer slides, the engine attends full-context and serves at most this many tokens.
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for knob in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, knob) <= 0:
                raise ValueError(f"model {self.name!r}: {knob} must be positive, got {getattr(self, knob)}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model {self.name!r}: num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe_dense_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def context_limit(self) -> int:
        """The most tokens the engine serves a sequence: the positions, cut to a sliding window (0: none)."""
        return min((n for n in (self.max_position_embeddings, self.sliding_window) if n), default=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def param_counts(self) -> ParamCounts:
        hidden = self.hidden_size
        heads = self.num_attention_heads
        norms = 2 * hidden * self.num_layers + hidden  # input and post-attention RMSNorm, final norm
        if self.is_mla:
            q_proj = (
                hidden * self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
                if self.q_lora_rank
                else hidden * heads * self.qk_head_dim
            )
            kv_proj = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
                self.qk_nope_head_dim + self.v_head_dim
            )
            attention_layer = q_proj + kv_proj + heads * self.v_head_dim * hidden
            norms += (self.q_lora_rank + self.kv_lora_rank) * self.num_layers
        else:
            q_size = heads * self.head_dim
            kv_size = self.num_kv_heads * self.head_dim
            attention_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden
            if self.qkv_bias:
                norms += (q_size + 2 * kv_size) * self.num_layers
            if self.qk_norm:
                norms += 2 * self.head_dim * self.num_layers
        per_expert = 3 * hidden * self.moe_intermediate_size  # gate, up and down projections
        return ParamCounts(
            embedding=self.vocab_size * hidden,
            lm_head=0 if self.tie_word_embeddings else self.vocab_size * hidden,
            attention=attention_layer * self.num_layers,
            dense_mlp=3 * hidden * self.intermediate_size * self.num_dense_layers,
            routed_experts=per_expert * self.num_experts * self.num_moe_layers,
            shared_experts=3 * hidden * self.shared_expert_intermediate_size * self.num_moe_layers,
            router=(
                (hidden + int(self.router_bias)) * self.num_experts + hidden * int(self.shared_expert_gate)
            )
            * self.num_moe_layers,
            norms_and_biases=norms,
            per_expert=per_expert,
        )


class ParamCounts(NamedTuple):
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int  # linear layers of attention, all layers
    dense_mlp: int
    routed_experts: int  # every routed expert of every MoE layer
    shared_experts: int
    router: int
    norms_and_biases: int
    per_expert: int  # one routed expert of one layer

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.lm_head
            + self.attention
            + self.dense_mlp
            + self.routed_experts
            + self.shared_experts
            + self.router
            + self.norms_and_biases
        )


# The config.json model types whose layout param_counts knows. Others (Gemma's four norms a layer and
# tied default, GPT-OSS's attention sinks and expert biases, ...) would be counted wrong, so are refused.
HF_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
)  # fmt: skip


def from_hf_config(config: dict[str, Any], name: str) -> ModelShape:
    """Build a shape from the keys of a Hugging Face config.json (Llama, Mistral, Qwen2/3, Qwen3-MoE,
    Mixtral, DeepSeek-V2/V3 families)."""
    if "text_config" in config:  # multimodal wrappers keep the language model's shape one level down
        config = {"model_type": config.get("model_type", ""), **config["text_config"]}
    if "model_type" not in config:
        raise ValueError(f"model {name!r}: config.json has no 'model_type'")
    model_type = str(config["model_type"])
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"model {name!r}: config.json's model_type {model_type!r} is not one the planner can count; "
            f"known: {', '.join(HF_MODEL_TYPES)}"
        )
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        num_experts = int(
            config.get("n_routed_experts")
            or config.get("num_experts")
            or config.get("num_local_experts")
            or 0
        )
        # Mixtral sizes its experts with intermediate_size (a moe_intermediate_size beside it is not read);
        # the others give moe_intermediate_size.
        moe_key = "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"
        moe_width = int(config.get(moe_key) or config.get("intermediate_size") or 0)
        shared_width = int(config.get("shared_expert_intermediate_size") or 0)
        if config.get("n_shared_experts"):
            shared_width = int(config["n_shared_experts"]) * moe_width
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),  # MLA overrides this below
            intermediate_size=int(config.get("intermediate_size") or 0),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type.startswith("qwen3"),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            sliding_window=_sliding_window(config, model_type),
        )
        if fields["kv_lora_rank"]:
            fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        if num_experts:
            fields.update(
                num_experts=num_experts,
                num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
                moe_intermediate_size=moe_width,
                shared_expert_intermediate_size=shared_width,
                moe_dense_layers=_moe_dense_layers(config, int(config["num_hidden_layers"])),
                router_bias=model_type == "deepseek_v3" or config.get("topk_method") == "noaux_tc",
                shared_expert_gate=model_type == "qwen2_moe",
            )
    except KeyError as exc:
        raise ValueError(f"model {name!r}: config.json has no {exc.args[0]!r}") from exc
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"model {name!r}: config.json has a malformed value ({exc})") from exc
    return ModelShape(name=name, **fields)


def _sliding_window(config: dict[str, Any], model_type: str) -> int:
    """The engine's window (attention_window.sliding_window) for the config transformers builds from this
    config.json, its defaults filled in where a key is missing: 0 where no layer slides."""
    view = {"model_type": model_type, **config}
    if model_type == "mistral":
        view.setdefault("sliding_window", 4096)
    if model_type.startswith("qwen"):
        if not view.get("use_sliding_window", False):
            return 0  # transformers' Qwen configs drop the window without use_sliding_window
        view.setdefault("max_window_layers", 28)
        if model_type == "qwen2_moe" and not view.get("layer_types"):
            # Qwen2-MoE slides the layers below max_window_layers (Qwen2/3 those from it on).
            return int(view.get("sliding_window") or 0) if view["max_window_layers"] > 0 else 0
    return sliding_window(SimpleNamespace(**view)) or 0


def _moe_dense_layers(config: dict[str, Any], num_layers: int) -> int:
    """DeepSeek keeps its first k layers dense; Qwen-MoE lists dense layers and may sparsify every n-th."""
    if config.get("first_k_dense_replace"):
        return int(config["first_k_dense_replace"])
    dense_listed = {int(layer) for layer in config.get("mlp_only_layers") or ()}
    sparse_step = int(config.get("decoder_sparse_step") or 1)
    return sum(1 for layer in range(num_layers) if layer in dense_listed or (layer + 1) % sparse_step)


def load_hf_dir(path: Path) -> ModelShape:
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {config_path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"cannot read {config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"cannot read {config_path}: expected a JSON object")
    return from_hf_config(config, path.name if path.is_dir() else path.parent.name)


def load_gguf(path: Path) -> ModelShape:
    """Read the shape from GGUF metadata and tensor names; the weights stay on disk (memory-mapped)."""
    from gguf import GGUFReader  # imported here: only GGUF input pays for it

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"cannot read GGUF file {path} (not GGUF, or truncated): {exc}") from exc

    def field(key: str, default: int | None = None) -> int:
        value = reader.fields.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"cannot read GGUF file {path}: metadata has no {key!r}")
            return default
        contents = value.contents()
        return int(max(contents) if isinstance(contents, list) else contents)

    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"cannot read GGUF file {path}: metadata has no 'general.architecture'")
    arch = str(arch_field.contents())
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"cannot read GGUF file {path}: no token_embd.weight tensor")
    hidden = field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    kv_lora_rank = field(f"{arch}.attention.kv_lora_rank", 0)
    rope_dim = field(f"{arch}.rope.dimension_count", 0)
    key_length = field(f"{arch}.attention.key_length_mla", field(f"{arch}.attention.key_length", 0))
    num_experts = field(f"{arch}.expert_count", 0)
    moe_width = field(f"{arch}.expert_feed_forward_length", 0)
    return ModelShape(
        name=path.stem,
        hidden_size=hidden,
        num_layers=field(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=key_length or hidden // heads,
        intermediate_size=field(f"{arch}.feed_forward_length", 0),
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        num_experts=num_experts,
        num_experts_per_tok=field(f"{arch}.expert_used_count", 0),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=field(
            f"{arch}.expert_shared_feed_forward_length", field(f"{arch}.expert_shared_count", 0) * moe_width
        ),
        shared_expert_gate="blk.0.ffn_gate_inp_shexp.weight" in tensors,
        moe_dense_layers=field(f"{arch}.leading_dense_block_count", 0) if num_experts else 0,
        router_bias=f"blk.{field(f'{arch}.leading_dense_block_count', 0)}.exp_probs_b.bias" in tensors,
        q_lora_rank=field(f"{arch}.attention.q_lora_rank", 0),
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=key_length - rope_dim if kv_lora_rank else 0,
        qk_rope_head_dim=rope_dim if kv_lora_rank else 0,
        v_head_dim=field(f"{arch}.attention.value_length_mla", field(f"{arch}.attention.value_length", 0))
        if kv_lora_rank
        else 0,
        max_position_embeddings=field(f"{arch}.context_length", 0),
    )
