"""Programmatic dependent launch (PDL, compute capability 9.0 and later).

A kernel launched with PDL may start while the kernel before it in the stream is still running: its
programs become resident as soon as every program of the one before has signalled (here at its start),
and wait in `griddepcontrol.wait` until that kernel has finished and its writes are visible. At batch-1
decode a step is some 300 short launches in a CUDA graph; without PDL each one waits for the previous
one to drain before its programs are even placed, and the HBM idles through every small kernel (norm,
rotary, attention, SiLU). With it, the placement overlaps the previous kernel. (A GEMV asking L2 for its
first weight bytes before it waits was tried and made the step slower: docs/performance.md.)

The rules every kernel here follows when its PDL constexpr is set, and which make it safe: it waits
before it reads anything an earlier kernel may have written and before it writes anything, and every
program waits, early exits included (a kernel whose programs exit unwaited could finish before its
predecessor, and its successor's wait would then pass too early). Kernels launched without PDL (torch's
own, cuBLAS) keep the stream's usual ordering, and a PDL kernel after them simply starts when they end.

With EARLY_READS a kernel reads before its wait what no kernel of the graph writes: the step's metadata
(positions, sequence lengths, query offsets, block tables, slots: copied in before the replay), the keys
and values of earlier steps (a decode's split, all but this step's own key) and weights. Those reads'
round trips then overlap the kernel before instead of following it; what the launch before writes (this
step's key and value, the activations) is still read after the wait. This holds because only the
graphs' launches use PDL, their inputs are copied in by operations that are not kernels, and a kernel
launched without PDL (torch's) starts only after everything before it has finished.

Only launches inside `in_graphs()` use it: the CUDA graph captures and their warm-ups (which build the
same kernel variants, so nothing compiles while a stream captures; worker/cuda_graphs.py). With it on
eager launches too, the 0.6B throughput run (host-bound, its prompt steps eager beside graphed decodes)
was 2% slower in three of three A/B pairs (H200, docs/performance.md). TOKENMILL_PDL=0 turns it off
(read once per device). The CPU interpreter never uses it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

ENV = "TOKENMILL_PDL"
_graph_depth = 0
# Whether kernels read their metadata (and a decode's earlier keys) before the PDL wait (see above);
# off: after it, for A/B. The kernels take it as their EARLY constexpr with or without PDL.
EARLY_READS = True


@contextlib.contextmanager
def in_graphs() -> Iterator[None]:
    """Launches inside go with PDL (where the device supports it): wrap a CUDA graph's capture and the
    warm-up forwards before it."""
    global _graph_depth
    _graph_depth += 1
    try:
        yield
    finally:
        _graph_depth -= 1


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL now."""
    return _graph_depth > 0 and x.is_cuda and _device_supports(x.device.index)


def launch_args(x: torch.Tensor, allowed: bool = True) -> dict[str, bool]:
    """The kernel's PDL constexpr and Triton's launch option, which must agree: splat into a launch.
    allowed=False: this launch goes without PDL wherever it runs."""
    on = allowed and enabled(x)
    return {"PDL": on, "launch_pdl": on}


@functools.lru_cache(maxsize=16)
def _device_supports(index: int | None) -> bool:
    if os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's prologue under PDL: let the next kernel's programs be placed (they wait before touching
    this kernel's outputs), then wait until the kernel before has finished and its writes are visible."""
    if PDL:
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
