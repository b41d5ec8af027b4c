"""resolve_dtype: "auto" on a CPU is bf16 only where the CPU multiplies bf16 in hardware."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker import device
from tokenmill.worker.device import resolve_device, resolve_dtype

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
