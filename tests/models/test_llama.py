"""The Llama model's construction: one kernel set, chosen at build, in every layer that dispatches."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from tokenmill.kernels import BACKEND_ENV, get_kernels
from tokenmill.models.llama import LlamaForCausalLM

from .test_utils import SMALL

CONFIG = Qwen3Config(**{**SMALL, "architectures": ["Qwen3ForCausalLM"]})  # Qwen3: q/k norms too


def kernel_holders(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if hasattr(module, "kernels") and module is not model]


def test_every_layer_holds_the_kernel_set_resolved_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    model = LlamaForCausalLM(CONFIG, max_position=64)
    assert model.kernels is get_kernels("cpu")
    # Per decoder layer: 2 norms, q/k norms, rotary, attention, activation.
    holders = kernel_holders(model)
    assert len(holders) == 2 * 7 + 1
    assert all(module.kernels is model.kernels for module in holders)


def test_an_explicit_kernel_set_reaches_every_layer() -> None:
    kernels = get_kernels("cpu")._replace(backend="custom")
    model = LlamaForCausalLM(CONFIG, max_position=64, kernels=kernels)
    assert all(module.kernels is kernels for module in kernel_holders(model))
