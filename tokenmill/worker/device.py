"""Which device the model runs on and in which dtype, when the config says "auto"."""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TORCH_DTYPE = {np.dtype(t): getattr(torch, t) for t in ("int64", "int32", "float32")}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but this machine has no CUDA device; use device='cpu' or 'auto'."
        )
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list of host values on the device without waiting for it: through pinned memory on a GPU (a copy
    from pageable memory first waits for every kernel already queued, the step's forward pass included,
    which would stall the host that async scheduling keeps ahead)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def staged(
    arrays: list[np.ndarray], dtype: np.dtype | list[np.dtype], device: torch.device
) -> list[torch.Tensor]:
    """The arrays on the device in one copy (dtype: one for all, or one per array): packed into pinned
    host memory (the caching host allocator does not reuse it before the copy is done), so the copy never
    blocks the host.

    Each array starts on a 16-byte boundary: Triton specialises kernels on pointer alignment, so
    views at batch-dependent offsets would compile new kernel variants in the middle of serving."""
    dtypes = [np.dtype(d) for d in dtype] if isinstance(dtype, list) else [np.dtype(dtype)] * len(arrays)
    offsets, total = [], 0
    for a, d in zip(arrays, dtypes):
        offsets.append(total)
        total += -(-a.size * d.itemsize // 16) * 16
    cuda = device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    packed = host.numpy()  # filled in place (converting each array to its dtype): no extra copy
    host_views = {d: packed.view(d) for d in set(dtypes)}  # one typed view per dtype, sliced by element
    for a, d, offset in zip(arrays, dtypes, offsets):
        start = offset // d.itemsize
        host_views[d][start : start + a.size] = a.ravel()
    if cuda:
        host = host.to(device, non_blocking=True)
    views = {d: host.view(_TORCH_DTYPE[d]) for d in host_views}
    tensors = []
    for a, d, offset in zip(arrays, dtypes, offsets):
        start = offset // d.itemsize
        tensor = views[d][start : start + a.size]
        tensors.append(tensor if a.ndim == 1 else tensor.view(a.shape))
    return tensors


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16).

    Asked of torch.cpu.get_capabilities() (cpuinfo, the same probe oneDNN dispatches on) rather than
    get_cpu_capability(), which says only "AVX512" and so cannot tell a bf16-capable Sapphire Rapids or
    Zen 4 from a Skylake. Without these instructions torch converts bf16 to fp32 around every matmul:
    on an AVX2-only AMD EPYC (Zen 3) bf16 linears ran 1.6-6x slower than fp32."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if config_dtype in (torch.float16, torch.bfloat16, "float16", "bfloat16"):
        return config_dtype if isinstance(config_dtype, torch.dtype) else _DTYPES[config_dtype]
    return torch.bfloat16
