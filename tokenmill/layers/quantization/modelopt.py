"""FP8 checkpoints as NVIDIA's Model Optimizer (nvidia-modelopt, `export_hf_checkpoint`) writes them: the
hub's nvidia/*-FP8 models. Its quantization config comes in two forms, both read here: config.json's
`quantization_config` (`quant_method: modelopt`, `quant_algo`, `ignore`, `kv_cache_scheme`) and the
older hf_quant_config.json beside it (`producer: {name: modelopt}`, `quantization: {quant_algo,
kv_cache_quant_algo, exclude_modules}`; loader/hf.py reads it where config.json has none).

- `quant_algo: FP8`: e4m3 weights with one `weight_scale` per tensor and a calibrated per-tensor
  `input_scale` (static activations): compressed-tensors' FP8 method with per-tensor inputs runs it.
- `FP8_PER_CHANNEL_PER_TOKEN`: one weight scale per output row, activations quantized per token at run
  time.
- The KV cache scales (`self_attn.k_proj.k_scale` and `v_proj.v_scale`, K and V stored as K / k_scale)
  are taken when the cache is FP8 (`kv_cache_dtype='fp8'`), as compressed-tensors' are.
Other algorithms (NVFP4, MXFP8, FP8 per-block weight-only, INT4 AWQ, mixed precision) are refused,
naming the field. Excluded modules are matched as Model Optimizer writes them: a name, a part of a
name, or a shell-style pattern (`model.layers.0.mlp*`).
"""

from __future__ import annotations

from fnmatch import fnmatch

from tokenmill.layers.linear import LinearMethodBase
from tokenmill.layers.quantization.compressed_tensors import ignored_layer
from tokenmill.layers.quantization.per_row_scaled import CompressedTensorsFp8LinearMethod

# quant_algo -> the input scheme of the FP8 method that runs it ("tensor": static per-tensor scales).
_ALGOS = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "token"}


def is_modelopt(config: dict) -> bool:
    """Whether a quantization_config is Model Optimizer's (its quant_method, or only its producer, as
    hf_quant_config.json and some config.json exports say it)."""
    producer = config.get("producer")
    return str(config.get("quant_method")).startswith("modelopt") or (
        isinstance(producer, dict) and producer.get("name") == "modelopt"
    )


class ModelOptConfig:
    def __init__(self, config: dict) -> None:
        nested = config.get("quantization")
        if isinstance(nested, dict):  # hf_quant_config.json's form
            where = "hf_quant_config.json quantization"
            algo, kv_algo = nested.get("quant_algo"), nested.get("kv_cache_quant_algo")
            self.ignore_key, exclude = "exclude_modules", nested.get("exclude_modules")
        else:
            where = "quantization_config"
            algo = config.get("quant_algo")
            scheme = config.get("kv_cache_scheme")
            fp8 = isinstance(scheme, dict) and (scheme.get("type"), scheme.get("num_bits")) == ("float", 8)
            kv_algo = "FP8" if fp8 else scheme
            self.ignore_key = "ignore" if "ignore" in config else "exclude_modules"
            exclude = config.get(self.ignore_key)
        self.where = where
        if not isinstance(algo, str) or algo.upper() not in _ALGOS:
            raise ValueError(
                f"{where}.quant_algo {algo!r} is not supported (supported: {', '.join(_ALGOS)}; NVFP4 and "
                "MXFP8 need FP4/MXFP8 tensor cores, which Hopper lacks)."
            )
        if kv_algo is not None and str(kv_algo).upper() != "FP8":
            raise ValueError(f"{where}: a KV cache quantized as {kv_algo!r} is not supported (only FP8).")
        names = exclude if isinstance(exclude, list) else [None]
        if exclude is not None and not all(isinstance(name, str) for name in names):
            raise ValueError(f"{where}.{self.ignore_key} must be a list of module names, got {exclude!r}.")
        self.algo = algo.upper()
        self.input_scheme = _ALGOS[self.algo]
        self.exclude: list[str] = list(exclude or [])
        self.uses_fp8 = True  # W8A8: FP8 activations

    def linear_method(self) -> LinearMethodBase:
        return CompressedTensorsFp8LinearMethod(self.input_scheme)

    def is_ignored(self, prefix: str) -> bool:
        listed = lambda name: any(entry in name or fnmatch(name, entry) for entry in self.exclude)  # noqa: E731
        return ignored_layer(prefix, listed, f"{self.where}.{self.ignore_key}")
