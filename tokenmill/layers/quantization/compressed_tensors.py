"""Checkpoints quantized by llm-compressor (`quant_method: compressed-tensors` in config.json):
`float-quantized` FP8 weights in e4m3 with a per-channel ([N, 1]) or per-tensor scale, activations dynamic
per token, static per tensor (`input_scale`), or none (weight-only, W8A16), or with one scale per block
(FP8_BLOCK, run by fp8_block.py); and `pack-quantized` W4A16,
4-bit integer weights in groups (or per channel), symmetric or with zero points (int4.py). A
`kv_cache_scheme` (FP8, per tensor) says the checkpoint holds each layer's K and V scales, with or
without quantized linears; an FP8 KV cache (kv_cache_dtype='fp8') then uses them.

FP8 and INT8 layers keep one scale per output row at run time (per_row_scaled.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from tokenmill.layers.linear import (
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from tokenmill.layers.quantization.int4 import Int4W4A16LinearMethod
from tokenmill.layers.quantization.per_row_scaled import (
    CompressedTensorsFp8LinearMethod,
    CompressedTensorsInt8LinearMethod,
)

FP8_FORMATS = ("float-quantized", "naive-quantized")
FORMATS = (*FP8_FORMATS, "int-quantized", "pack-quantized")


class CompressedTensorsConfig:
    """The parsed quantization_config of a compressed-tensors checkpoint."""

    def __init__(self, config: dict) -> None:
        where = "quantization_config"
        # A transform (QuIP's or SpinQuant's rotations, applied online to the linears' inputs) or sparse
        # weights (2:4, bitmask) change what the linears compute: refused, not loaded as dense weights.
        if config.get("transform_config"):
            raise ValueError(f"{where}.transform_config (online rotations) is not supported.")
        sparse = (config.get("sparsity_config") or {}).get("format") or "dense"
        if sparse != "dense":
            raise ValueError(
                f"{where}.sparsity_config.format {sparse!r} is not supported (supported: dense)."
            )
        groups = config.get("config_groups") or {}
        kv_scales = _kv_cache_scheme(config.get("kv_cache_scheme"), f"{where}.kv_cache_scheme")
        if not groups and kv_scales:  # the KV cache's scales only; the linears as they are
            self.format, self.input_scheme, self.ignore = "dense", None, []
            return
        fmt = config.get("format")
        if fmt not in FORMATS:
            raise ValueError(
                f"{where}.format {fmt!r} is not supported for compressed-tensors (supported: "
                f"{', '.join(FORMATS)})."
            )
        self.format = fmt
        if len(groups) != 1:
            raise ValueError(f"{where}.config_groups: one group is supported, got {len(groups)}.")
        ((name, group),) = groups.items()
        where = self.where = f"{where}.config_groups.{name}"
        targets = group.get("targets") or []
        if targets != ["Linear"]:
            raise ValueError(f"{where}.targets {targets!r} is not supported (supported: ['Linear']).")
        weights = group.get("weights") or {}
        activations = group.get("input_activations")
        self.int8 = fmt == "int-quantized" or (fmt == "pack-quantized" and weights.get("num_bits") == 8)
        if self.int8:
            self._int8(weights, activations, where)
            self._finish(config, group, where)
            return
        if fmt == "pack-quantized":
            _expect(weights, f"{where}.weights", type="int", num_bits=4, dynamic=False)
            self.weight_strategy = _one_of(weights, f"{where}.weights", "strategy", ("group", "channel"))
            self.group_size = int(weights.get("group_size") or 0) if self.weight_strategy == "group" else 0
            if self.weight_strategy == "group" and self.group_size <= 0:
                raise ValueError(
                    f"{where}.weights.group_size {weights.get('group_size')!r} must be positive."
                )
            self.symmetric = bool(weights.get("symmetric"))
            # GPTQ's activation order: "group" keeps each column's group in weight_g_idx; "weight" (alias
            # "static") only changed how the weights were rounded.
            actorder = weights.get("actorder")
            if actorder not in (None, "weight", "static", "group", "dynamic"):
                raise ValueError(f"{where}.weights.actorder {actorder!r} is not supported.")
            self.group_order = f"{where}.weights.actorder" if actorder in ("group", "dynamic") else None
            if activations is not None:
                raise ValueError(
                    f"{where}.input_activations: 4-bit weights run W4A16; activations must be null."
                )
            self.input_scheme: str | None = None
            self._finish(config, group, where)
            return
        _expect(weights, f"{where}.weights", type="float", num_bits=8, symmetric=True, dynamic=False)
        strategies = ("channel", "tensor", "block")
        self.weight_strategy = _one_of(weights, f"{where}.weights", "strategy", strategies)
        self.input_scheme = None  # None: weight-only; "token": dynamic; "tensor": static
        if self.weight_strategy == "block":
            self.block = _fp8_blocks(weights, activations, where)
            self.input_scheme = "group"
        elif activations is not None:
            self.input_scheme = _input_scheme(activations, where, "float")
        self._finish(config, group, where)

    def _int8(self, weights: dict, activations: dict | None, where: str) -> None:
        """INT8 weights, symmetric, a scale per channel or per tensor; int8 activations per token or per
        tensor, or none (weight-only: 8-bit `pack-quantized`, which packs them, or `int-quantized`)."""
        _expect(weights, f"{where}.weights", type="int", num_bits=8, symmetric=True, dynamic=False)
        self.weight_strategy = _one_of(weights, f"{where}.weights", "strategy", ("channel", "tensor"))
        self.input_scheme = None
        if activations is not None:
            if self.format == "pack-quantized":
                raise ValueError(
                    f"{where}.input_activations: packed 8-bit weights run W8A16; activations must be null."
                )
            self.input_scheme = _input_scheme(activations, where, "int")

    def _finish(self, config: dict, group: dict, where: str) -> None:
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations is not supported.")
        self.ignore = list(config.get("ignore") or [])

    @property
    def uses_fp8(self) -> bool:
        """Whether the matmuls need FP8 tensor cores (FP8 activations; fp8_block.py's blocks run
        without them where the GPU has none)."""
        return self.format in FP8_FORMATS and self.input_scheme in ("token", "tensor")

    def linear_method(self) -> LinearMethodBase:
        if self.format == "dense":
            return UnquantizedLinearMethod()
        if self.int8:
            return CompressedTensorsInt8LinearMethod(
                self.input_scheme, packed=self.format == "pack-quantized"
            )
        if self.format == "pack-quantized":
            return Int4W4A16LinearMethod(
                self.group_size, self.symmetric, self.group_order, f"{self.where}.weights.group_size"
            )
        if self.input_scheme == "group":
            from tokenmill.layers.quantization.fp8_block import Fp8BlockLinearMethod  # it imports this

            field = f"{self.where}.weights.block_structure"
            return Fp8BlockLinearMethod(*self.block, scale_name="weight_scale", field=field)
        return CompressedTensorsFp8LinearMethod(self.input_scheme)

    def is_ignored(self, prefix: str) -> bool:
        """Whether the layer named `prefix` stays unquantized: an exact name or a `re:` pattern of the
        ignore list (matched from the start of the name), checked against the checkpoint's names of a
        fused layer's parts."""
        return ignored_layer(prefix, self._listed, "quantization_config.ignore")

    def _listed(self, name: str) -> bool:
        return any(re.match(e[3:], name) if e.startswith("re:") else e == name for e in self.ignore)


def ignored_layer(prefix: str, listed: Callable[[str], bool], field: str) -> bool:
    """Whether the layer named `prefix` stays unquantized, by whether the checkpoint's names of it are
    `listed` (a fused layer's: each of its parts', which must agree; a ValueError naming `field` where
    only some parts are listed: one fused layer here, quantized or not as a whole)."""
    names = _checkpoint_names(prefix)
    hits = [listed(name) for name in names]
    if all(hits):
        return True
    if any(hits):
        some = [name for name, hit in zip(names, hits) if hit]
        rest = [name for name, hit in zip(names, hits) if not hit]
        raise ValueError(
            f"{field} leaves {some} unquantized but not {rest}: tokenmill runs them as one fused layer "
            f"({prefix}), quantized or not as a whole; list all of its parts or none."
        )
    return False


def not_converted(prefix: str, modules: list[str], key: str = "modules_to_not_convert") -> bool:
    """modules_to_not_convert (fine-grained FP8, GPTQ, AWQ; AutoFP8's ignored_layers: `key`) as
    transformers reads it, an entry naming every module whose name holds it, against the checkpoint's
    names of a fused layer's parts."""
    listed = lambda name: any(entry in name for entry in modules)  # noqa: E731
    return ignored_layer(prefix, listed, f"quantization_config.{key}")


def _checkpoint_names(prefix: str) -> list[str]:
    for fused, parts in (
        (".qkv_proj", (".q_proj", ".k_proj", ".v_proj")),
        (".gate_up_proj", (".gate_proj", ".up_proj")),
    ):
        if prefix.endswith(fused):
            return [prefix[: -len(fused)] + part for part in parts]
    return [prefix]


# Per-tensor FP8 KV scales as llm-compressor saves them, as older compressed-tensors checkpoints did, and
# as NVIDIA's Model Optimizer does (k_proj.k_scale, v_proj.v_scale).
_KV_SCALE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale|k_proj\.(k)_scale|v_proj\.(v)_scale)$"
)


def kv_scales_aside(
    weights: Iterable[tuple[str, torch.Tensor]], into: dict[int, tuple[float, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (model names) without its KV cache scales, which fill `into` as
    {layer: (k_scale, v_scale)} once the weights are consumed; a layer with one of the two is an error."""
    found: dict[tuple[int, str], float] = {}
    for name, tensor in weights:
        match = _KV_SCALE.match(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.numel()} values; a KV scale has 1.")
        value = float(tensor.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"checkpoint tensor {name!r} is {value}; a KV scale must be positive, finite.")
        found[(int(match.group(1)), next(g for g in match.groups()[1:] if g))] = value
    for layer in sorted({layer for layer, _ in found}):
        if (layer, "k") not in found or (layer, "v") not in found:
            raise ValueError(f"checkpoint has only one of layer {layer}'s k_scale and v_scale.")
        into[layer] = (found[(layer, "k")], found[(layer, "v")])


def _fp8_blocks(weights: dict, activations: dict | None, where: str) -> tuple[int, int]:
    """llm-compressor's FP8_BLOCK: weight scales per block_structure [rows, columns] (`weight_scale`,
    as fine-grained FP8's weight_scale_inv), activations quantized at run time per token and per group
    of the blocks' columns."""
    block = weights.get("block_structure")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}.weights.block_structure {block!r} must be [rows, columns] of a block.")
    if activations is None:
        raise ValueError(
            f"{where}.input_activations: block FP8 weights are supported with dynamic FP8 activations in "
            "groups of the blocks' columns (FP8_BLOCK), not weight-only."
        )
    _expect(activations, f"{where}.input_activations", type="float", num_bits=8, strategy="group")
    _expect(activations, f"{where}.input_activations", dynamic=True, group_size=block[1])
    return block[0], block[1]


def _kv_cache_scheme(scheme: dict | None, where: str) -> bool:
    """Whether the checkpoint stores per-tensor FP8 scales of each layer's K and V (`self_attn.k_scale`,
    `self_attn.v_scale`), which an FP8 KV cache then uses; any other KV scheme is refused."""
    if scheme is None:
        return False
    _expect(scheme, where, type="float", num_bits=8, symmetric=True, dynamic=False)
    _one_of(scheme, where, "strategy", ("tensor",))
    return True


def _input_scheme(activations: dict, where: str, kind: str) -> str:
    """8-bit symmetric activations of `kind` (float: e4m3, int: int8): "token" (dynamic per token) or
    "tensor" (a static per-tensor input_scale), the only pairings of strategy and dynamic supported."""
    where = f"{where}.input_activations"
    _expect(activations, where, type=kind, num_bits=8, symmetric=True)
    strategy = _one_of(activations, where, "strategy", ("token", "tensor"))
    dynamic = activations.get("dynamic")
    if (strategy, dynamic) not in (("token", True), ("tensor", False)):
        raise ValueError(
            f"{where}: strategy {strategy!r} with dynamic {dynamic!r} is not supported (supported: token "
            "and dynamic, tensor and static)."
        )
    return strategy


def _expect(args: dict, where: str, **wanted: object) -> None:
    for key, value in wanted.items():
        if args.get(key) != value:
            raise ValueError(f"{where}.{key} {args.get(key)!r} is not supported (supported: {value!r}).")


def _one_of(args: dict, where: str, key: str, allowed: tuple[str, ...]) -> str:
    value = args.get(key)
    if value not in allowed:
        raise ValueError(f"{where}.{key} {value!r} is not supported (supported: {', '.join(allowed)}).")
    return value
