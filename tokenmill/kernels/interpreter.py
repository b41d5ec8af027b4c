"""Whether Triton runs its kernels in its interpreter, which runs no inline PTX (the kernels' paths
without it then). Read once, when the first Triton module imports this one, as @triton.jit reads the
variable when those modules are imported; not in the package's __init__, which is imported earlier (the
tests set TRITON_INTERPRET just before they import the Triton modules)."""

from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
