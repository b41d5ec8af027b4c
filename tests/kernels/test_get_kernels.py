"""Kernel dispatch: references on the CPU, Triton on CUDA, the environment override, and layers that keep
the set chosen when they were built."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import BACKEND_ENV, Kernels, get_kernels, reference
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.norm import RMSNorm

REPO_ROOT = Path(__file__).resolve().parents[2]
has_triton = importlib.util.find_spec("triton") is not None


def test_cpu_gets_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    kernels = get_kernels(torch.device("cpu"))
    assert isinstance(kernels, Kernels)
    assert kernels.backend == "torch"
    assert kernels.paged_attention is reference.paged_attention
    assert kernels.fused_add_rms_norm is reference.fused_add_rms_norm
    assert get_kernels("cpu") is kernels


@pytest.mark.skipif(not has_triton, reason="needs triton")
def test_env_forces_triton_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels import attention, norm

    monkeypatch.setenv(BACKEND_ENV, "triton")
    kernels = get_kernels(torch.device("cpu"))
    assert kernels.backend == "triton"
    assert kernels.paged_attention is attention.paged_attention
    assert kernels.rms_norm is norm.rms_norm
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert get_kernels(torch.device("cpu")).backend == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_triton, reason="needs a CUDA device and triton")
def test_cuda_gets_triton_unless_forced_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert get_kernels(torch.device("cuda")).backend == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert get_kernels(torch.device("cuda")).backend == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_triton, reason="needs a CUDA device and triton")
def test_layers_built_on_cuda_get_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with torch.device("cuda"):
        assert get_kernels().backend == "triton"
        assert RMSNorm(64).kernels.backend == "triton"
    assert RMSNorm(64).kernels.backend == "torch"


def test_layers_keep_the_kernels_they_were_built_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    with torch.device("cpu"):
        assert get_kernels() is get_kernels("cpu")
        norm, act = RMSNorm(6), SiluAndMul()
    assert norm.kernels is act.kernels is get_kernels("cpu")
    # A backend that get_kernels would refuse: the forward passes never ask for one.
    monkeypatch.setenv(BACKEND_ENV, "flash")
    x = torch.randn(3, 6)
    torch.testing.assert_close(norm(x), reference.rms_norm(x, norm.weight, norm.eps))
    torch.testing.assert_close(act(x), reference.silu_and_mul(x))


def test_unknown_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV}='flash'.*'torch' or 'triton'"):
        get_kernels(torch.device("cpu"))


def test_kernels_import_without_triton() -> None:
    # A meta-path finder that hides triton, so the import path without it is exercised here too.
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('hidden')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import torch\n"
        "from tokenmill.kernels import get_kernels\n"
        "assert get_kernels(torch.device('cuda')).backend == 'torch'\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.stdout.strip() == "ok", result.stderr


def test_integer_knobs_name_the_variable_when_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' integer environment knobs (read at import): unset or empty, the default; not an
    integer or not an allowed value, a ValueError naming the variable."""
    from tokenmill.kernels import env_int

    monkeypatch.delenv("TOKENMILL_TEST_KNOB", raising=False)
    assert env_int("TOKENMILL_TEST_KNOB", 7) == 7
    monkeypatch.setenv("TOKENMILL_TEST_KNOB", "")
    assert env_int("TOKENMILL_TEST_KNOB", 7) == 7
    monkeypatch.setenv("TOKENMILL_TEST_KNOB", "2")
    assert env_int("TOKENMILL_TEST_KNOB", 1, allowed=(1, 2)) == 2
    monkeypatch.setenv("TOKENMILL_TEST_KNOB", "two")
    with pytest.raises(ValueError, match="TOKENMILL_TEST_KNOB='two': give an integer"):
        env_int("TOKENMILL_TEST_KNOB", 1)
    monkeypatch.setenv("TOKENMILL_TEST_KNOB", "3")
    with pytest.raises(ValueError, match="TOKENMILL_TEST_KNOB='3': give one of 1, 2"):
        env_int("TOKENMILL_TEST_KNOB", 1, allowed=(1, 2))
