"""resolve_dtype: "auto" on a CPU is bf16 only where the CPU multiplies bf16 in hardware; staged: host
arrays of mixed dtypes and shapes reach the device in one copy, each view aligned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.worker import device
from tokenmill.worker.device import resolve_device, resolve_dtype, staged

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2": True, "avx512_bf16": True}, torch.bfloat16),
        ({"avx2": True, "amx_bf16": True}, torch.bfloat16),
        ({"avx2": True, "avx512_f": True}, torch.float32),  # AVX-512 without BF16: bf16 is emulated
        ({"avx2": True}, torch.float32),
    ],
)
def test_auto_on_cpu_follows_native_bf16(monkeypatch, flags, expected) -> None:
    monkeypatch.setattr(device.torch.cpu, "get_capabilities", lambda: flags)
    assert resolve_dtype("auto", None, CPU) == expected


def test_explicit_dtype_wins_over_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(device.torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    assert resolve_dtype("float32", None, CPU) == torch.float32
    assert resolve_dtype("bfloat16", None, CPU) == torch.bfloat16


def test_resolve_device_cpu() -> None:
    assert resolve_device("cpu") == CPU


@pytest.mark.parametrize("device_name", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_staged_mixed_dtypes_keep_values_shapes_and_alignment(device_name) -> None:
    if device_name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-(2**40), 2**40, 7),  # int64
        np.zeros(0, np.int64),  # empty
        rng.integers(0, 1000, (3, 5)).astype(np.int32),  # 2-D
        rng.integers(0, 9, 3),  # int64 values bound for int32
        rng.standard_normal(5).astype(np.float32),
        np.arange(1),
    ]
    dtypes = [np.int64, np.int64, np.int32, np.int32, np.float32, np.int64]
    tensors = staged(arrays, dtypes, torch.device(device_name))
    for array, dtype, tensor in zip(arrays, dtypes, tensors):
        assert tensor.device.type == device_name and tuple(tensor.shape) == array.shape
        assert (
            tensor.dtype == {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}[dtype]
        )
        assert np.array_equal(tensor.cpu().numpy(), array.astype(dtype))
        assert tensor.data_ptr() % 16 == 0  # Triton specialises on alignment: every view starts on 16 bytes
    (single,) = staged([np.arange(3)], np.int32, torch.device(device_name))  # one dtype for all
    assert single.dtype == torch.int32 and single.tolist() == [0, 1, 2]
