"""The Llama family in one forward: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), SmolLM; tied or untied embeddings, any GQA ratio and head_dim.
Tokens are flat and varlen: hidden states are [num_tokens, hidden_size]."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding


class ArchFlags:
    """What differs between the family's members, read off the config once."""

    def __init__(self, config) -> None:
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_bias = attention_bias or arch == "Qwen2ForCausalLM"
        self.o_bias = attention_bias and arch != "Qwen2ForCausalLM"
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = arch == "Qwen3ForCausalLM"
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))


class LlamaAttention(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = flags.num_heads, flags.num_kv_heads, flags.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=flags.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=flags.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags.qk_norm else None
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_position)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, md))


class LlamaMLP(nn.Module):
    def __init__(self, config, flags: ArchFlags) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=flags.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=flags.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, flags, max_position)
        self.mlp = LlamaMLP(config, flags)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, flags: ArchFlags, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, flags, max_position) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF checkpoint names that land in a slice of one of our fused parameters: (ours, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.flags = ArchFlags(config)
        self.model = LlamaModel(config, self.flags, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.flags.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def _shard_sizes(self, fused: str) -> list[int]:
        if fused == "qkv_proj":
            f = self.flags
            return [f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim, f.num_kv_heads * f.head_dim]
        inter = self.config.intermediate_size
        return [inter, inter]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our parameters, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.flags.tie_word_embeddings:
                continue
            target, shard = name, None
            for hf_part, (ours, index) in _STACKED.items():
                if f".{hf_part}." in name:
                    target, shard = name.replace(f".{hf_part}.", f".{ours}."), index
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}.")
            dest = param.data
            if shard is not None:
                sizes = self._shard_sizes(target.split(".")[-2])
                dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
                loaded.add(f"{target}#{shard}")
            else:
                loaded.add(target)
            if dest.shape != tensor.shape:
                got, expected = tuple(tensor.shape), tuple(dest.shape)
                raise ValueError(f"checkpoint tensor {name!r} has shape {got}, expected {expected}.")
            dest.copy_(tensor)
        missing = [n for n in self._expected_names() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}.")

    def _expected_names(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            fused = name.split(".")[-2] if name.count(".") else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                names += [f"{name}#{i}" for i in range(len(self._shard_sizes(fused)))]
            else:
                names.append(name)
        return names
