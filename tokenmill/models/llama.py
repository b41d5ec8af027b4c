"""The Llama family in one forward: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), SmolLM; tied or untied embeddings, any GQA ratio and head_dim. Its
mixture-of-experts members swap the MLP for layers/fused_moe.py: Mixtral (every layer) and Qwen3-MoE
(the layers its config makes sparse). Tokens are flat and varlen: hidden states are
[num_tokens, hidden_size]."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.kernels import Kernels, QuantizedRows, ScaledRows, get_kernels, resolved
from tokenmill.layers.activation import check_hidden_act, gated_activation
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.fused_linear import fused_linear, row_quant_for
from tokenmill.layers.fused_moe import FusedMoE, expert_params_mapping
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantization.compressed_tensors import kv_scales_aside
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.utils import load_model_weights

if TYPE_CHECKING:
    from tokenmill.models.eagle import FeatureSink

logger = logging.getLogger(__name__)


# transformers' classes of these read no attention_bias / mlp_bias: a config.json's stray field is
# none of the model's (Qwen2 always biases q/k/v, never o).
_NO_ATTENTION_BIAS = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")
_NO_MLP_BIAS = _NO_ATTENTION_BIAS + ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class ArchFlags:
    """What differs between the family's members, read off the config once."""

    def __init__(self, config) -> None:
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch.endswith("Model"):  # a bare model (an embedding checkpoint) is its family's member
            arch = arch[: -len("Model")] + "ForCausalLM"
        attention_bias = arch not in _NO_ATTENTION_BIAS and bool(getattr(config, "attention_bias", False))
        self.qkv_bias = attention_bias or arch == "Qwen2ForCausalLM"
        self.o_bias = attention_bias
        self.mlp_bias = arch not in _NO_MLP_BIAS and bool(getattr(config, "mlp_bias", False))
        self.qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.hidden_act = getattr(config, "hidden_act", None) or "silu"
        check_hidden_act(self.hidden_act)
        # Mixture of experts: Mixtral's in every layer, Qwen3-MoE's where its config puts them.
        self.mixtral = arch == "MixtralForCausalLM"
        self.num_experts = (
            getattr(config, "num_local_experts", 0) if self.mixtral
            else getattr(config, "num_experts", 0) if arch == "Qwen3MoeForCausalLM" else 0
        )  # fmt: skip
        if self.num_experts:
            if self.hidden_act not in ("silu", "swish"):
                raise ValueError(
                    f"hidden_act {self.hidden_act!r}: the experts run SiLU only (supported: silu)."
                )
            self.top_k = config.num_experts_per_tok
            # Mixtral's experts are intermediate_size wide (transformers reads no other key for them).
            self.moe_intermediate_size = (
                config.intermediate_size if self.mixtral
                else getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            )  # fmt: skip
            self.renormalize = self.mixtral or bool(getattr(config, "norm_topk_prob", False))
            self._dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
            self._sparse_step = getattr(config, "decoder_sparse_step", 1) or 1

    def is_moe_layer(self, index: int) -> bool:
        return (
            bool(self.num_experts)
            and index not in self._dense_layers
            and (index + 1) % self._sparse_step == 0
        )


class LlamaAttention(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int, kernels: Kernels) -> None:
        super().__init__()
        hidden, eps, self.head_dim = config.hidden_size, config.rms_norm_eps, flags.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, flags.num_heads, flags.num_kv_heads, bias=flags.qkv_bias
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(flags.num_heads * self.head_dim, hidden, bias=flags.o_bias)
        self.q_norm = RMSNorm(self.head_dim, eps, kernels) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, kernels) if flags.qk_norm else None
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_position, kernels)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, kernels, self.rotary_emb
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, md: AttentionMetadata, scaled_out: bool = False
    ) -> torch.Tensor | ScaledRows:
        """scaled_out: the caller's next launch (an RMSNorm) takes o_proj's product with its scales left
        to it (LinearBase.forward_scaled)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The attention layer rotates q and k in the launch that stores K and V.
        out = self.attn(q, k, v, md, positions)
        return self.o_proj.forward_scaled(out) if scaled_out else self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, flags: ArchFlags, kernels: Kernels) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=flags.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=flags.mlp_bias)
        self.act = gated_activation(flags.hidden_act, kernels)

    def forward(self, x: torch.Tensor | QuantizedRows, scaled_out: bool = False) -> torch.Tensor | ScaledRows:
        """The activation goes into the gate/up projection's store where fused_linear can fold it, and
        quantizes its output for down_proj where that asks (W8A8). scaled_out: the caller's next launch
        (an RMSNorm) takes down_proj's product with its scales left to it."""
        h = fused_linear(self.gate_up_proj, x, act=self.act, then=self.down_proj)
        return self.down_proj.forward_scaled(h) if scaled_out else self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int, kernels: Kernels, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, flags, max_position, kernels)
        self.mlp: nn.Module
        if flags.is_moe_layer(index):
            self.mlp = FusedMoE(
                flags.num_experts, flags.top_k, config.hidden_size, flags.moe_intermediate_size,
                flags.renormalize, kernels,
            )  # fmt: skip
        else:
            self.mlp = LlamaMLP(config, flags, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # Whether forward may return the MLP's product with its scales left to the next RMSNorm
        # (ScaledRows): set by LlamaModel, whose next launch for it is a norm; other callers get tensors.
        self.scaled_out = False

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | ScaledRows,
        residual: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor | ScaledRows, torch.Tensor]:
        # The norms quantize their output for the linear after them where it asks (W8A8: row_quant_for);
        # they take the O and down projections' products with their scales not yet applied (ScaledRows).
        quant = row_quant_for(self.self_attn.qkv_proj, hidden)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, quant=quant)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant)
        hidden = self.self_attn(positions, hidden, md, scaled_out=True)
        mlp = self.mlp
        quant = row_quant_for(mlp.gate_up_proj, hidden) if isinstance(mlp, LlamaMLP) else None
        hidden, residual = self.post_attention_layernorm(hidden, residual, quant)
        if isinstance(mlp, LlamaMLP):
            return mlp(hidden, scaled_out=self.scaled_out), residual
        return mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int, kernels: Kernels) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, flags, max_position, kernels, index)
            for index in range(config.num_hidden_layers)
        )
        for layer in self.layers:  # each layer's output goes to the next one's norm, or to self.norm
            layer.scaled_out = True
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # Set by an EAGLE drafter (models/eagle.py): every full forward leaves the head's features there.
        self.feature_sink: FeatureSink | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; with num_layers, after only the first num_layers layers
        (self-speculation drafts with them)."""
        sink = self.feature_sink if num_layers is None else None
        taps = (sink.layers or ()) if sink is not None else ()
        hidden, residual = self.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers[:num_layers]):
            if index in taps:  # the residual stream entering this layer
                sink.tap(index, hidden if residual is None else resolved(hidden) + residual)
            hidden, residual = layer(positions, hidden, residual, md)
        if len(self.layers) in taps:  # the stream after the last layer, before the final norm
            sink.tap(len(self.layers), resolved(hidden) + residual)
        hidden, _ = self.norm(hidden, residual)
        if sink is not None and not taps:
            sink.put(0, hidden)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that land in a shard of one of our fused parameters: (ours, theirs, shard id).
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self, config, max_position: int, kernels: Kernels | None = None, *, lm_head: bool = True
    ) -> None:
        """lm_head=False builds the bare model, for pooling: hidden states, no logits."""
        super().__init__()
        self.config = config
        self.flags = ArchFlags(config)
        # Chosen once, for the device the model is built on; every layer keeps this set.
        self.kernels = kernels or get_kernels()
        self.model = LlamaModel(config, self.flags, max_position, self.kernels)
        # The MoE torch reference's shapes follow the routing: no CUDA graphs around it.
        self.graph_safe = not self.flags.num_experts or self.kernels.backend == "triton"
        self.lm_head: ParallelLMHead | None = None
        if lm_head:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.flags.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError("this model was built without an LM head (runner=pooling); it has no logits.")
        return self.lm_head(hidden)[..., : self.config.vocab_size]  # drop the padded vocab's columns

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our parameters, fusing q/k/v and gate/up."""
        without_head = self.lm_head is None or self.flags.tie_word_embeddings
        # With the head tied to the embedding, every lm_head tensor is left out: a quantized head's too
        # (its scales, packed words), said once below; an lm_head.weight unlike the embedding unties it.
        skip = ["rotary_emb.inv_freq"] + (["lm_head."] if without_head else [])
        head_tensors: dict[str, torch.Tensor] = {}
        # A bare model's checkpoint (Qwen3Model, ...) names its tensors without the "model." prefix.
        named = ((_with_model_prefix(name), tensor) for name, tensor in weights)
        if self.lm_head is not None and self.flags.tie_word_embeddings:
            named = _noting_head(named, head_tensors)
        elif self.lm_head is not None:
            named = _refusing_quantized_head(named)
        if self.flags.mixtral:
            named = ((_mixtral_name(name), tensor) for name, tensor in named)
        mapping = expert_params_mapping(self.flags.num_experts) + self.stacked_params_mapping
        kv_scales: dict[int, tuple[float, float]] = {}
        load_model_weights(self, kv_scales_aside(named, kv_scales), mapping, skip_substrs=skip)
        for index, scales in kv_scales.items():
            self.model.layers[index].self_attn.attn.stored_kv_scales = scales
        quantized_head = [name for name in head_tensors if name != "lm_head.weight"]
        if quantized_head:
            logger.warning(
                "the checkpoint stores a quantized lm_head (%s) but config.json ties the head to the "
                "embedding (tie_word_embeddings): the head runs as the embedding, unquantized",
                ", ".join(quantized_head[:4]),
            )
        elif "lm_head.weight" in head_tensors:
            self._untie_if_different(head_tensors["lm_head.weight"])

    def _untie_if_different(self, head: torch.Tensor) -> None:
        """A tied checkpoint that stores an lm_head.weight unlike its embedding runs that head, as
        transformers does (it leaves such a pair untied)."""
        embed = self.model.embed_tokens
        weight = nn.Parameter(torch.empty_like(embed.weight), requires_grad=False)
        embed.weight_loader(weight, head)
        if torch.equal(weight, embed.weight):
            return
        weight.output_dim, weight.weight_loader = 0, self.lm_head.weight_loader
        self.lm_head.weight = weight
        logger.warning(
            "config.json ties the LM head to the embedding (tie_word_embeddings) but the checkpoint's "
            "lm_head.weight differs from it: the head runs as stored, untied, as transformers runs it"
        )


def _refusing_quantized_head(named: Iterable[tuple[str, torch.Tensor]]):
    for name, tensor in named:
        if name.startswith("lm_head.") and name not in ("lm_head.weight", "lm_head.bias"):
            raise ValueError(
                f"the checkpoint stores a quantized LM head ({name}), which is not supported: keep lm_head "
                "unquantized (in the quantization config's ignore list, or modules_to_not_convert; GPTQ's "
                "lm_head false), as llm-compressor and AutoGPTQ do by default."
            )
        yield name, tensor


def _noting_head(named: Iterable[tuple[str, torch.Tensor]], seen: dict[str, torch.Tensor]):
    for name, tensor in named:
        if name.startswith("lm_head."):
            seen[name] = tensor
        yield name, tensor


_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_name(name: str) -> str:
    """Mixtral's `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down) as Qwen3-MoE names them."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, _, tail = name.rpartition(".experts.")
    if head:
        expert, projection, rest = tail.split(".", 2)
        name = f"{head}.experts.{expert}.{_MIXTRAL_EXPERT_NAMES.get(projection, projection)}.{rest}"
    return name


def _with_model_prefix(name: str) -> str:
    if name.startswith(("model.", "lm_head.")):
        return name
    return "model." + name
