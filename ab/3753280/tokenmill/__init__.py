"""tokenmill: an LLM inference engine and serving stack."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM


def __getattr__(name: str):
    # Imported lazily so that `tokenmill plan` and `tokenmill bench serve` start without torch.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
