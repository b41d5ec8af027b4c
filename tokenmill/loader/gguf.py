"""GGUF checkpoints (llama.cpp's format): the Hugging Face config, float32 weights under Hugging Face
names and shapes, and the tokenizer, all rebuilt from one file's metadata and tensors."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from tokenmill.loader.gguf_dequant import dequantize
from tokenmill.loader.gguf_file import GGUFFile, GGUFTensorTable, file_identity, first_shard, open_gguf
from tokenmill.loader.gguf_rope import ROPE_FREQS, rope_parameters


class GGUFFamily(NamedTuple):
    config_class: type[PretrainedConfig]
    architecture: str  # the Hugging Face `architectures` entry
    config_keys: frozenset[str]  # the optional config fields this config class takes


_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily(
        LlamaConfig, "LlamaForCausalLM", frozenset({"head_dim", "attention_bias", "mlp_bias"})
    ),
    "mistral": GGUFFamily(MistralConfig, "MistralForCausalLM", frozenset({"head_dim", "sliding_window"})),
    "qwen2": GGUFFamily(Qwen2Config, "Qwen2ForCausalLM", frozenset()),
    "qwen3": GGUFFamily(Qwen3Config, "Qwen3ForCausalLM", frozenset({"head_dim", "attention_bias"})),
    "qwen3moe": GGUFFamily(
        Qwen3MoeConfig, "Qwen3MoeForCausalLM", frozenset({"head_dim", "attention_bias", "experts"})
    ),
    # llama.cpp writes Mixtral as "llama" with expert tensors.
    "mixtral": GGUFFamily(
        MixtralConfig, "MixtralForCausalLM", frozenset({"head_dim", "sliding_window", "experts"})
    ),
}

# llama.cpp's converter permutes the q/k rows of "llama"-architecture files (Mistral included) to suit
# its interleaved rope; Qwen files keep the rotate-half order of the original checkpoint.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# What every block of the file must hold (Qwen3's adds its q/k norms).
_REQUIRED_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
_DENSE_FFN_TENSORS = ("ffn_gate", "ffn_up", "ffn_down")
# A mixture-of-experts block: the router, then every expert's gate, up and down stacked in one tensor each.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MOE_FFN_TENSORS = ("ffn_gate_inp", *_EXPERT_TENSORS)


def load_gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of the model in the GGUF file at `path` (from the cache when this file was
    converted before: parsing the metadata of a 49k-token vocabulary takes seconds). A split model is
    named by any of its shards."""
    path = first_shard(path)
    return _converted(path, "config", AutoConfig.from_pretrained, lambda: _build_config(open_gguf(path)))


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the file dequantized to float32, under its Hugging Face name and shape.

    The file is opened, and rejected if malformed, at call time rather than at the first `next()`.
    A tied lm_head is not yielded: the model ties it to model.embed_tokens.weight. Where each tensor lies
    comes from the cache once this file was read (beside its config, which must be read first)."""
    path = first_shard(path)
    config = load_gguf_config(path)
    load = functools.partial(GGUFTensorTable.load, path)
    table = _converted(path, "tensors", load, lambda: GGUFTensorTable.of(open_gguf(path)))
    return _iter_weights(table, config)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer transformers builds from the file, with its special tokens and chat template,
    converted once and then loaded from the cache (about 8 s against a quarter of a second)."""
    # Imported here: transformers' tokenizer classes take ~1.6 s to import, and an engine core reads the
    # weights of a GGUF file without its tokenizer.
    from transformers import AutoTokenizer

    path = first_shard(path)
    return _converted(path, "tokenizer", AutoTokenizer.from_pretrained, lambda: _convert_tokenizer(path))


def _convert_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    file = open_gguf(path)
    tokens = file.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise file.error("it holds no tokenizer (no tokenizer.ggml.tokens); pass a tokenizer separately.")
    directory, filename = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    except (KeyError, OSError, ValueError) as exc:
        raise file.error(f"transformers cannot build its tokenizer ({exc!r}).") from exc
    # transformers names the llama-family eos token after the bos id and leaves pad unset: take every
    # special token from the id the file states.
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = file.get(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and 0 <= token_id < len(tokens.data):
            setattr(tokenizer, f"{role}_token", tokens.contents(token_id))
    # transformers adds no BOS to an encoded text whatever the file says; llama.cpp follows the file, and
    # without the key adds one for a SentencePiece ("llama") vocabulary, as Llama 2 and Mistral need.
    spm = file.get("tokenizer.ggml.model", None) == "llama"
    add_bos = bool(file.get("tokenizer.ggml.add_bos_token", spm))
    add_eos = bool(file.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos, add_eos) != (tokenizer.add_bos_token, tokenizer.add_eos_token):
        tokenizer.add_bos_token, tokenizer.add_eos_token = add_bos, add_eos
    chat_template = file.get("tokenizer.chat_template", None)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _cache_dir(path: str, kind: str) -> str:
    """Where a conversion of this very file (its path, size and modification time) is kept."""
    size, mtime_ns = file_identity(path)
    identity = f"{os.path.abspath(path)}:{size}:{mtime_ns}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, "tokenmill", "gguf", f"{name}-{key}", kind)


def _converted(path: str, kind: str, load: Callable[[str], Any], convert: Callable[[], Any]) -> Any:
    """This file's `kind` (config, tokenizer or tensor table) from the cache when converted before, else
    converted and written beside the others, atomically (another process may be doing the same); a cache
    that cannot be read or written only costs this start its seconds."""
    if not os.path.isfile(path):
        return convert()  # (which names the missing file)
    directory = _cache_dir(path, kind)
    if os.path.isdir(directory):
        try:
            return load(directory)
        except (OSError, ValueError):
            pass
    converted = convert()
    partial = None
    entry = os.path.dirname(directory)
    try:
        new_entry = not os.path.isdir(entry)
        os.makedirs(entry, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=f".{kind}-", dir=entry)
        converted.save_pretrained(partial)
        os.rename(partial, directory)
        if new_entry:
            _record_source(entry, path)
            _prune_stale_entries(os.path.dirname(entry), keep=entry)
    except OSError:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
    return converted


_SOURCE = "source.json"


def _record_source(entry: str, path: str) -> None:
    """Which file (path, size, mtime) a cache entry holds the conversions of, so that a later start can
    tell when that file is gone or rewritten (the entry's own key cannot be reversed)."""
    partial = os.path.join(entry, f".{_SOURCE}.{os.getpid()}")
    with open(partial, "w") as file:
        json.dump({"path": os.path.abspath(path), "identity": file_identity(path)}, file)
    os.replace(partial, os.path.join(entry, _SOURCE))


def _prune_stale_entries(root: str, keep: str) -> None:
    """Removes the cache entries of files that no longer exist or were rewritten since (a conversion of
    a file read before is never looked up again): a downloaded model moved or replaced, a temporary file.
    Entries without a source record (older ones) are left alone. Done when a new entry is written, which
    is rare, so that the cache does not grow by one entry a file ever read."""
    for name in os.listdir(root):
        entry = os.path.join(root, name)
        if entry == keep:
            continue
        try:
            with open(os.path.join(entry, _SOURCE)) as file:
                source = json.load(file)
        except (OSError, ValueError):
            continue
        try:
            stale = file_identity(source["path"]) != source["identity"]
        except OSError:
            stale = True
        except (KeyError, TypeError):
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def _family(file: GGUFFile) -> str:
    if file.architecture == "llama":
        # llama.cpp writes Mistral checkpoints as "llama"; only the model's name tells them apart.
        names = (file.get(key, "") for key in ("general.name", "general.basename"))
        if "blk.0.ffn_gate_exps.weight" in file.tensors:
            return "mixtral"
        return "mistral" if any("mistral" in name.lower() for name in names) else "llama"
    if file.architecture not in _FAMILIES:
        supported = "llama (Mistral and Mixtral included), qwen2, qwen3, qwen3moe"
        raise file.error(f"the {file.architecture!r} architecture is unsupported; supported: {supported}.")
    return file.architecture


def _build_config(file: GGUFFile) -> PretrainedConfig:
    family_name = _family(file)
    family = _FAMILIES[family_name]
    hidden_size = file.arch_get("embedding_length")
    num_attention_heads = file.layer_get("attention.head_count")
    head_dim = file.arch_get("attention.key_length", hidden_size // num_attention_heads)
    rotary_dim = file.arch_get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise file.error(f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are unsupported.")

    num_hidden_layers = file.arch_get("block_count")
    _check_tensors_present(file, num_hidden_layers, "experts" in family.config_keys)
    tokens = file.reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else 0
    if int(file.tensors["token_embd.weight"].shape[1]) != vocab_size:
        # llama.cpp refuses such a file too: its token list is the vocabulary.
        raise file.error(f"token_embd.weight does not match the {vocab_size}-token vocabulary.")

    fields: dict[str, Any] = {
        "architectures": [family.architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": file.layer_get("feed_forward_length"),
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": file.layer_get("attention.head_count_kv", num_attention_heads),
        "max_position_embeddings": file.arch_get("context_length"),
        "rms_norm_eps": file.arch_get("attention.layer_norm_rms_epsilon"),
        "rope_parameters": rope_parameters(file, head_dim),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _eos_token_ids(file),
        "pad_token_id": file.get("tokenizer.ggml.padding_token_id", None),
    }
    optional = {
        "head_dim": head_dim,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in file.tensors,
        # llama.cpp runs Mistral without a sliding window unless the file states one.
        "sliding_window": file.arch_get("attention.sliding_window", None),
    }
    fields.update({key: value for key, value in optional.items() if key in family.config_keys})
    if "experts" in family.config_keys:
        fields.update(_expert_fields(file, family_name))
    return family.config_class(**fields)


def _expert_fields(file: GGUFFile, family_name: str) -> dict[str, Any]:
    num_experts = file.arch_get("expert_count")
    top_k = file.arch_get("expert_used_count")
    expert_width = file.arch_get("expert_feed_forward_length", None) or file.layer_get("feed_forward_length")
    if family_name == "mixtral":
        return {
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": expert_width,
        }
    # llama.cpp's Qwen3-MoE renormalises the chosen experts' weights; every layer is sparse.
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_width,
        "intermediate_size": file.layer_get("feed_forward_length", expert_width),
        "norm_topk_prob": bool(file.arch_get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _check_tensors_present(file: GGUFFile, num_layers: int, experts: bool) -> None:
    """A ValueError naming the first tensor of the Llama-family layout the file lacks (llama.cpp refuses
    such a file too), before any weight is read."""
    layer_kinds = _REQUIRED_LAYER_TENSORS + (_MOE_FFN_TENSORS if experts else _DENSE_FFN_TENSORS)
    if file.architecture in ("qwen3", "qwen3moe"):
        layer_kinds += ("attn_q_norm", "attn_k_norm")
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{index}.{kind}.weight" for index in range(num_layers) for kind in layer_kinds]
    missing = [name for name in required if name not in file.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise file.error(f"tensor {missing[0]!r} is missing{more}.")


def _eos_token_ids(file: GGUFFile) -> int | list[int] | None:
    """The eos id, widened to a list when the file names separate end-of-turn or end-of-message tokens
    (a Llama 3 instruct model ends its turn with <|eot_id|>, not with its eos token)."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = file.get(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _iter_weights(table: GGUFTensorTable, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = table.architecture in _PERMUTED_ARCHITECTURES
    for tensor_name, tensor_type, data in table.tensors():
        if tensor_name == ROPE_FREQS:
            continue
        stem, _, suffix = tensor_name.rpartition(".")
        block, index, kind = (stem.split(".", 2) + ["", ""])[:3]
        try:
            weights = dequantize(data, tensor_type)  # a new tensor: the data is a read-only memory map
        except NotImplementedError as exc:
            raise table.error(f"tensor {tensor_name!r}: {exc}.") from exc
        if block == "blk" and kind in _EXPERT_TENSORS:  # [experts, out, in]: one tensor per expert
            for expert, expert_weights in enumerate(weights):
                name = f"model.layers.{index}.mlp.experts.{expert}.{_EXPERT_TENSORS[kind]}.{suffix}"
                yield name, expert_weights.clone()
            continue
        name = _hf_tensor_name(table, tensor_name)
        if permuted and ".self_attn.q_proj." in name:
            weights = _unpermute_rows(weights, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weights = _unpermute_rows(weights, config.num_key_value_heads)
        yield name, weights


def _hf_tensor_name(table: GGUFTensorTable, gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    block, index, kind = (stem.split(".", 2) + ["", ""])[:3]
    if block == "blk" and index.isdigit() and kind in _LAYER_TENSORS:
        return f"model.layers.{index}.{_LAYER_TENSORS[kind]}.{suffix}"
    raise table.error(f"tensor {gguf_name!r} has no counterpart in a dense Llama-family model.")


def _unpermute_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Within each head the converter interleaves the two rope
    halves (row order 0, d/2, 1, d/2+1, ...); this restores rotate-half order (0, 1, ..., d-1)."""
    shape = weights.shape
    grouped = weights.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
    return grouped.transpose(1, 2).contiguous().reshape(shape)
