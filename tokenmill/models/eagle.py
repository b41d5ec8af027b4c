"""EAGLE draft heads over a Llama-family target, from their published checkpoint layouts.

An EAGLE head drafts from the target's own hidden states: its row at position p reads the embedding of
token p + 1 and the target's feature at p, and predicts token p + 2. It has its own paged KV cache (one
or a few layers), written for every position the target computes.

- EAGLE-1 (the EAGLE repository's LLaMA/Vicuna heads; vLLM's "eagle"): the feature is the target's
  last hidden state (after its final norm). fc maps [embedding, feature] (2h) to h; the decoder layers
  follow, the first without its input norm; their output, with no final norm, goes through the target's
  LM head. Checkpoint names: fc.weight (fc.bias), layers.N.*, optionally embed_tokens.weight (else the
  target's embedding is shared).
- EAGLE-3 (vLLM's "eagle3"): the feature is the target's residual stream entering three of its layers
  (2, L // 2 and L - 3 unless the config names them), concatenated (3h), which fc maps to h. One
  "midlayer" whose attention reads [input_layernorm(embedding), hidden_norm(feature)] (2h), a final
  norm, and its own LM head over a draft vocabulary (draft_vocab_size) with d2t, the offset from each
  draft token id to the target's. Steps after the first feed back the midlayer's output before the
  final norm (h wide, so fc is skipped). Checkpoint names: midlayer.*, fc.weight, norm.weight,
  lm_head.weight, d2t, t2d (unused); embed_tokens.weight optional.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.kernels import Kernels
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.llama import ArchFlags, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tokenmill.models.utils import building_on, load_model_weights


class FeatureSink:
    """Where the target leaves the hidden states its EAGLE head drafts from, for every token of a step:
    its final hidden states (layers None), or the residual stream entering each of `layers`, side by
    side. A static buffer, so the target's CUDA graphs write it as its eager forward does."""

    def __init__(
        self,
        layers: tuple[int, ...] | None,
        hidden_size: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.hidden_size = hidden_size
        width = hidden_size * (len(layers) if layers else 1)
        self.buffer = torch.zeros(max_tokens, width, dtype=dtype, device=device)

    def put(self, index: int, hidden: torch.Tensor) -> None:
        num_tokens = hidden.shape[0]
        if num_tokens > self.buffer.shape[0]:
            raise ValueError(
                f"a step of {num_tokens} tokens is larger than the EAGLE feature buffer "
                f"({self.buffer.shape[0]} tokens, max_num_batched_tokens)."
            )
        h = self.hidden_size
        self.buffer[:num_tokens, index * h : (index + 1) * h].copy_(hidden)

    def tap(self, layer: int, stream: torch.Tensor) -> None:
        """The stream entering `layer`, into every place that reads it."""
        for index, tapped in enumerate(self.layers):
            if tapped == layer:
                self.put(index, stream)


def eagle3_feature_layers(draft_config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input stream an EAGLE-3 head reads (num_target_layers: the stream after
    the last layer). A config's eagle_aux_hidden_state_layer_ids name layers whose *output* is read (as
    SGLang reads them): the input of the layer after each."""
    eagle_config = getattr(draft_config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or getattr(
        draft_config, "eagle_aux_hidden_state_layer_ids", None
    )
    if ids:
        layers = tuple(int(i) + 1 for i in ids)
    else:
        layers = (2, num_target_layers // 2, num_target_layers - 3)
    if any(not 0 <= i <= num_target_layers for i in layers):
        raise ValueError(
            f"speculative_config model: EAGLE-3 feature layers {layers} are outside the target's "
            f"{num_target_layers} layers."
        )
    return layers


class _Eagle1Layer(LlamaDecoderLayer):
    """A Llama decoder layer; EAGLE-1's first one has no input norm (fc's output enters attention as
    it is)."""

    def __init__(self, config, flags, max_position, kernels, first: bool) -> None:
        super().__init__(config, flags, max_position, kernels, index=0)  # a draft's layers are dense
        self.first = first
        if first:
            del self.input_layernorm

    def forward(self, positions, hidden, residual, md):
        if self.first:
            residual = hidden
            hidden = self.self_attn(positions, hidden, md)
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        return super().forward(positions, hidden, residual, md)


class EagleHead(nn.Module):
    """EAGLE-1. forward(input_ids, positions, md, features) -> (hidden for the LM head, next feature)."""

    feature_layers: tuple[int, ...] | None = None

    def __init__(self, config, target: nn.Module, max_position: int, kernels: Kernels, names: set[str]):
        super().__init__()
        flags = ArchFlags(config)
        self.config = config
        hidden = config.hidden_size
        self.own_embedding = "embed_tokens.weight" in names
        if self.own_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        else:  # shared with the target, not registered here (nor loaded twice)
            self._target_embedding = (target.model.embed_tokens,)
        self.fc = ColumnParallelLinear(2 * hidden, hidden, bias="fc.bias" in names)
        self.layers = nn.ModuleList(
            _Eagle1Layer(config, flags, max_position, kernels, first=i == 0)
            for i in range(config.num_hidden_layers)
        )
        self._target = (target,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.own_embedding else self._target_embedding[0])(input_ids)

    def forward(self, input_ids, positions, md: AttentionMetadata, features: torch.Tensor):
        hidden = self.fc(torch.cat([self.embed(input_ids), features], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, md)
        out = hidden + residual
        return out, out

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden).argmax(dim=-1)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The EAGLE repository's heads carry the target's LM head (or none) and an unused input norm.
        skip = ["lm_head.", "layers.0.input_layernorm.", "rotary_emb.inv_freq"]
        load_model_weights(self, weights, _STACKED, skip_substrs=skip)


class _Eagle3Layer(nn.Module):
    def __init__(self, config, flags, max_position, kernels) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, flags, max_position, kernels)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * hidden, attn.head_dim, attn.num_heads, attn.num_kv_heads, bias=flags.qkv_bias
        )
        self.mlp = LlamaMLP(config, flags, kernels)
        self.input_layernorm = RMSNorm(hidden, eps, kernels)
        self.hidden_norm = RMSNorm(hidden, eps, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels)

    def forward(self, positions, embeds, hidden, md):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """EAGLE-3. forward(input_ids, positions, md, features) -> (hidden for the LM head, next feature)."""

    def __init__(self, config, target: nn.Module, max_position: int, kernels: Kernels, names: set[str]):
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"speculative_config model: EAGLE-3 heads of {config.num_hidden_layers} layers are not "
                "supported (the published heads have one)."
            )
        flags = ArchFlags(config)
        self.config = config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or target.config.hidden_size
        self.feature_layers = eagle3_feature_layers(config, len(target.model.layers))
        self.own_embedding = "embed_tokens.weight" in names
        if self.own_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        else:
            self._target_embedding = (target.model.embed_tokens,)
        self.fc = ColumnParallelLinear(
            target_hidden * len(self.feature_layers), hidden, bias=bool(getattr(config, "bias", False))
        )
        self.midlayer = _Eagle3Layer(config, flags, max_position, kernels)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, kernels)
        self._target = (target,)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.own_lm_head = "lm_head.weight" in names
        if self.own_lm_head:
            self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        elif self.draft_vocab_size != target.config.vocab_size:
            raise ValueError(
                "speculative_config model: an EAGLE-3 head with a draft vocabulary needs its lm_head.weight."
            )
        # Target token id of each draft token id (d2t holds the offsets); identity without a draft vocab.
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.own_embedding else self._target_embedding[0])(input_ids)

    def forward(self, input_ids, positions, md: AttentionMetadata, features: torch.Tensor):
        if features.shape[-1] != self.config.hidden_size:  # the target's features, not our own
            features = self.fc(features)
        hidden, residual = self.midlayer(positions, self.embed(input_ids), features, md)
        return self.norm(hidden, residual)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.own_lm_head:
            return self._target[0].compute_logits(hidden).argmax(dim=-1)
        logits = self.lm_head(hidden)[..., : self.draft_vocab_size]
        return self.draft_to_target[logits.argmax(dim=-1)]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def named():
            for name, tensor in weights:
                if name == "d2t":
                    if tensor.shape != (self.draft_vocab_size,):
                        raise ValueError(
                            f"checkpoint tensor 'd2t' has shape {tuple(tensor.shape)}, expected "
                            f"({self.draft_vocab_size},) (draft_vocab_size)."
                        )
                    self.draft_to_target.copy_(tensor.long() + torch.arange(self.draft_vocab_size))
                elif name.startswith("midlayers.0."):  # some heads name their one layer this way
                    yield "midlayer." + name[len("midlayers.0.") :], tensor
                else:
                    yield name, tensor

        load_model_weights(self, named(), _STACKED, skip_substrs=["t2d", "rotary_emb.inv_freq"])


# Heads name their weights as Llama does: the same fusing of q/k/v and gate/up.
_STACKED = LlamaForCausalLM.stacked_params_mapping


def head_weight_files(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        files = sorted(f for f in os.listdir(path) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not files:
        raise ValueError(f"speculative_config model {path!r} has no *.safetensors or pytorch_model*.bin.")
    return [os.path.join(path, f) for f in files]


def iter_head_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """An EAGLE head's tensors: safetensors, or the EAGLE repository's pytorch_model.bin."""
    yield from _head_tensors(path, keys_only=False)


def _head_tensors(path: str, keys_only: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name without a "model." prefix, tensor) of every file; keys_only: the names alone (a .bin is
    read whole either way)."""
    from safetensors import safe_open

    for file in head_weight_files(path):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name.removeprefix("model."), None if keys_only else f.get_tensor(name)
        else:
            for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
                yield name.removeprefix("model."), None if keys_only else tensor


def is_eagle3(names: set[str], hf_config) -> bool:
    """EAGLE-3 by architecture name or by its midlayer, whichever the checkpoint shows."""
    arch = " ".join(getattr(hf_config, "architectures", None) or [])
    return "eagle3" in arch.lower() or any(name.startswith(("midlayer.", "midlayers.")) for name in names)


def build_eagle_head(
    method: str, path: str, target: nn.Module, max_position: int, device: torch.device, dtype: torch.dtype
) -> EagleHead | Eagle3Head:
    """The head at `path` for `target`, in the target's dtype and kernels, its weights loaded."""
    from tokenmill.loader.hf import load_hf_config

    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config model {path!r} is not a directory with a config.json.")
    config = load_hf_config(path)
    names = {name for name, _ in _head_tensors(path, keys_only=True)}
    eagle3 = method == "eagle3" or is_eagle3(names, config)
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config model {path!r} has a vocabulary of {config.vocab_size} tokens, the target "
            f"{target.config.vocab_size}: an EAGLE head must be trained for its target."
        )
    cls = Eagle3Head if eagle3 else EagleHead
    with building_on(device, dtype):
        head = cls(config, target, max_position, target.kernels, names)
    head.load_weights(iter_head_weights(path))
    return head.eval()
