"""GPTQ and AWQ 4-bit checkpoints (`quant_method: gptq | awq` in config.json), the int4 formats most
found on the hub, and GPTQ's 8-bit ones (Qwen's GPTQ-Int8). Both keep, per linear layer and with the
output features as columns:

- GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"): `qweight` int32 [K/8, N], eight 4-bit values
  per word along K (value j in bits 4j, unsigned 0..15); `qzeros` int32 [K/group, N/8], packed along N
  the same way, each stored as zero - 1; `scales` [K/group, N]; `g_idx` int32 [K], each input row's
  group (rows in order unless desc_act reorders them).
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [K, N/8] packed along N with the nibbles of a word
  holding columns 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` int32 [K/group, N/8] packed the same way (no offset);
  `scales` [K/group, N].

w[n, k] = (q - zero) * scale of k's group. Each tensor is turned into the layout of int4.py as it loads
(packed along K per output row, zero points unpacked, scales [N, groups]), so both run on the same
Triton W4A16 GEMM and reference as compressed-tensors' pack-quantized checkpoints.

GPTQ with `bits: 8` packs four 8-bit values a word the same ways (qweight [K/4, N] along K, qzeros
[K/group, N/4] along N, each stored as zero - 1; values unsigned 0..255): they load unpacked, int8
q - 128 [N, K] and zero points int8 [N, groups] (int16 in a layer where one is 256: a zero point of 0,
stored as byte 0xFF, which GPTQ's readers take back as 256), and run through int8.py's
int8_grouped_linear.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from tokenmill.kernels import GemvFusion
from tokenmill.kernels.quant_reference import PACK, pack_int4, unpack_int4
from tokenmill.layers.linear import LinearMethodBase, RowParallelLinear
from tokenmill.layers.quantization.compressed_tensors import ignored_layer, not_converted
from tokenmill.layers.quantization.int4 import (
    add_group_index,
    checkpoint_rows,
    dequantize_in_order,
    int4_gemv_takes,
    int4_matmul,
    order_input_columns,
    ordered_input,
)
from tokenmill.layers.quantization.int8 import int8_grouped_linear, unpack_int8
from tokenmill.layers.sharding import ShardId, WeightLoader, check_columns_split, check_dtype

METHODS = ("gptq", "awq")
# AWQ packs column 8c + AWQ_ORDER[j] into nibble j of word c; reading nibble j back gives that column.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The nibble that holds column c of an AWQ word.
_AWQ_NIBBLE_OF = [AWQ_ORDER.index(c) for c in range(PACK)]


class GptqAwqConfig:
    def __init__(self, config: dict) -> None:
        self.method = config.get("quant_method")
        where = "quantization_config"
        supported = (4, 8) if self.method == "gptq" else (4,)
        self.bits = config.get("bits")
        if self.bits not in supported:
            raise ValueError(
                f"{where}.bits {self.bits!r} is not supported (supported: {', '.join(map(str, supported))})."
            )
        # Missing: 128, transformers' default for both (GPTQConfig, AwqConfig), as it loads such a config.
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or isinstance(group_size, bool):
            raise ValueError(f"{where}.group_size {group_size!r} must be an integer (a positive one or -1).")
        self.group_size = group_size
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"{where}.group_size {config.get('group_size')!r} must be positive or -1.")
        if self.method == "gptq":
            fmt = config.get("checkpoint_format", "gptq")
            if fmt != "gptq":
                raise ValueError(f"{where}.checkpoint_format {fmt!r} is not supported (supported: gptq).")
        else:
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}.version {version!r} is not supported (supported: gemm).")
            if config.get("zero_point") is False:
                raise ValueError(f"{where}.zero_point false is not supported (AWQ checkpoints have zeros).")
        self.ignore: list[str] = list(config.get("modules_to_not_convert") or [])
        # GPTQModel's per-module rules, first match wins: "-:<regex>" leaves a module unquantized; a
        # "+:<regex>" (or bare) rule overrides the fields it names for the modules it matches (sym and
        # desc_act change nothing here: qzeros and g_idx are read either way).
        self.dynamic: dict[str, dict] = dict(config.get("dynamic") or {})
        self._base = {"bits": self.bits, "group_size": config.get("group_size")}
        # Input columns in an order of their own somewhere (the MoE experts' kernel takes them in order).
        rules = [rule for rule in self.dynamic.values() if isinstance(rule, dict)]
        self.desc_act = bool(config.get("desc_act")) or any(rule.get("desc_act") for rule in rules)

    uses_fp8 = False

    def linear_method(self) -> LinearMethodBase:
        return GptqAwqLinearMethod(self.method, self.group_size, self.bits)

    def is_ignored(self, prefix: str) -> bool:
        if not_converted(prefix, self.ignore):
            return True
        return bool(self.dynamic) and ignored_layer(
            prefix, self._dynamic_skips, "quantization_config.dynamic"
        )

    def _dynamic_skips(self, name: str) -> bool:
        """Whether `name`'s first matching dynamic rule leaves it unquantized; a rule that quantizes it
        otherwise than the config's own fields is refused (one scheme for every quantized layer here)."""
        for pattern, overrides in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return True
                continue
            if not re.match(pattern.removeprefix("+:"), name):
                continue
            changed = {k: v for k, v in (overrides or {}).items() if k in self._base and v != self._base[k]}
            if changed:
                base = {k: self._base[k] for k in changed}
                raise ValueError(
                    f"quantization_config.dynamic[{pattern!r}] quantizes {name} with {changed}, unlike the "
                    f"config's {base}: per-module bits or group_size "
                    "are not supported (only '-:' rules, which leave modules unquantized)."
                )
            return False
        return False


def _unpack_columns(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [R, C/8] packed along the columns -> unsigned values [R, C] in column order."""
    rows = packed.shape[0]
    values = unpack_int4(packed, packed.shape[1] * PACK).to(torch.int32) + 8  # nibble order
    if awq:
        values = values.reshape(rows, -1, PACK)[..., _AWQ_NIBBLE_OF].reshape(rows, -1)
    return values


class GptqAwqLinearMethod(LinearMethodBase):
    """Parameters named as the checkpoint names them (qweight, qzeros, scales; g_idx for GPTQ), holding
    int4.py's layout: qweight [N, K/8] packed along K, qzeros int8 [N, groups], scales [N, groups]."""

    def __init__(self, method: str, group_size: int, bits: int = 4) -> None:
        self.awq = method == "awq"
        self.group_size = group_size
        self.bits = bits

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None,
        weight_loader: WeightLoader,
    ) -> None:
        rows, columns = sum(output_partition_sizes), input_size_per_partition
        # A row-parallel layer under tensor parallelism holds its columns' slice: whole groups of them (the
        # checkpoint's tensors, converted whole, are cut along K as they load; per-channel scales whole).
        split = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        stored_columns = input_size if split else columns
        if split and self.group_size > 0:
            what = f"quantization_config.group_size {self.group_size}"
            check_columns_split(columns, self.group_size, layer.tp_size, what)
        group = self.group_size if self.group_size > 0 else columns
        pack = 32 // self.bits  # values a word
        if columns % pack:
            raise ValueError(
                f"input size {columns} is not a multiple of {pack}, as {self.bits}-bit packing needs"
            )
        num_groups = math.ceil(columns / group)
        stored_groups = math.ceil(stored_columns / self.group_size) if self.group_size > 0 else 1
        awq = self.awq

        def stored_shape(name: str, n: int) -> tuple[int, int]:
            """The tensor's shape in the file, for a layer (or part) of n output rows."""
            packed_n = math.ceil(n / pack)
            return {
                "qweight": (stored_columns, packed_n) if awq else (stored_columns // pack, n),
                "qzeros": (stored_groups, packed_n),
                "scales": (stored_groups, n),
            }[name]

        def add(name: str, data: torch.Tensor, convert) -> None:
            param = nn.Parameter(data, requires_grad=False)
            param.output_dim = 0
            param.input_dim = 1 if split and (name == "qweight" or self.group_size > 0) else None

            def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
                # Checked as stored: converted, a wrong shape would be reported transposed or unpacked.
                check_dtype(param.dtype if name == "scales" else torch.int32, loaded)
                expected = stored_shape(name, checkpoint_rows(layer, shard_id, output_size))
                if tuple(loaded.shape) != expected:
                    grouped = (
                        "" if name == "qweight" else f" with quantization_config.group_size {self.group_size}"
                    )
                    raise ValueError(
                        f"shape {tuple(loaded.shape)} does not match the expected {expected} (the "
                        f"{'AWQ' if awq else 'GPTQ'} layout of {name} for this layer{grouped})"
                    )
                weight_loader(param, convert(loaded), shard_id)

            param.weight_loader = load
            layer.register_parameter(name, param)

        def qweight(loaded: torch.Tensor) -> torch.Tensor:
            if self.bits == 8:  # [K/4, n] along K -> int8 q - 128 [n, K]
                return unpack_int8(loaded.t().contiguous(), stored_columns)
            if awq:  # [K, n/8] along N -> values [K, n] -> ours [n, K/8]
                values = _unpack_columns(loaded, awq=True).t().to(torch.int8) - 8
                return pack_int4(values)
            return loaded.t().contiguous()  # [K/8, n] along K: word for word our layout, transposed

        def qzeros(loaded: torch.Tensor) -> torch.Tensor:
            if self.bits == 8:  # [groups, n/4] along N, each zero - 1 -> zero - 128, int16 [n, groups]
                # A zero point of 0 was stored as byte 0xFF (0 - 1) and every GPTQ reader takes it back as
                # 256: zero - 128 = 128, past int8 until after_loading finds none such.
                zeros = unpack_int8(loaded, loaded.shape[1] * 4).to(torch.int16) + 1
                return zeros.t().contiguous()
            zeros = _unpack_columns(loaded, awq=awq) + (0 if awq else 1)  # GPTQ stores zero - 1
            return (zeros - 8).t().to(torch.int8).contiguous()

        if self.bits == 8:
            add("qweight", torch.zeros(rows, columns, dtype=torch.int8), qweight)
        else:
            add("qweight", torch.zeros(rows, columns // PACK, dtype=torch.int32), qweight)
        zero_dtype = torch.int16 if self.bits == 8 else torch.int8
        add("qzeros", torch.zeros(rows, num_groups, dtype=zero_dtype), qzeros)
        add("scales", torch.zeros(rows, num_groups, dtype=params_dtype or torch.get_default_dtype()),
            lambda loaded: loaded.t().contiguous())  # fmt: skip
        if not awq:
            in_order = self.group_size if self.group_size > 0 else stored_columns
            add_group_index(layer, "g_idx", stored_columns, "quantization_config.desc_act", in_order)
        layer.int4_group_size = group
        layer.int4_in_features = columns

    def after_loading(self, layer: nn.Module) -> None:
        if not self.awq:
            order_input_columns(layer, "qweight", "quantization_config.desc_act")
        # GPTQ's symmetric checkpoints (`sym: true`, the quantizers' default) store every zero point at
        # the middle of the range, which is zero as held here: the kernels then take no zero points (one
        # load a tile and one subtraction a value fewer; per channel at decode's rows, the skinny W8A16
        # kernel). A layer whose shard has any other zero keeps them all.
        layer.zeros_in_use = bool(layer.qzeros.any())
        if layer.qzeros.dtype == torch.int16 and int(layer.qzeros.max()) <= 127:
            # 8-bit zero points in int8, as the kernels have been tested with, unless one is 256 (above):
            # the kernels read them as numbers either way.
            layer.qzeros = nn.Parameter(layer.qzeros.data.to(torch.int8), requires_grad=False)

    def _zeros(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.qzeros if getattr(layer, "zeros_in_use", True) else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = ordered_input(layer, x)
        matmul = int8_grouped_linear if self.bits == 8 else int4_matmul
        return matmul(x, layer.qweight, layer.scales, self._zeros(layer), layer.int4_group_size, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_in_order(layer, layer.qweight, layer.scales, layer.qzeros)

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        if self.bits != 4:
            return False
        return int4_gemv_takes(x, layer.qweight, layer.scales, self._zeros(layer), layer.int4_group_size)

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        x = ordered_input(layer, x)
        return int4_matmul(
            x, layer.qweight, layer.scales, self._zeros(layer), layer.int4_group_size, bias, fusion
        )
