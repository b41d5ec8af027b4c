"""Grammar masks onto a step's logits: rows the host filled before the step samples (staged with the
step's inputs), or rows in pinned memory the host fills after the sampling is queued, which the masking
kernel waits for and reads in place (HostMasks; kernels/host_wait.py)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from tokenmill.structured_outputs import apply_bitmask
from tokenmill.worker.device import staged


class HostMasks:
    """A grammar step's masks in pinned host memory, which the device reads once the host has filled
    them: `array` [rows, words] int32 to fill, then publish() (exactly once, also when the fill fails,
    or the device waits until it gives up) writes the step's number into the counter the device polls
    (kernels/host_wait.py). Steps publish in the order they were queued. On a CPU (where only tests
    take this path: the engine fills the masks before the step samples there) the sampling waits for
    `published` on the host."""

    def __init__(self, tensor: torch.Tensor, counter: torch.Tensor, target: int) -> None:
        self.tensor = tensor
        self.array = tensor.numpy()
        self.counter = counter.numpy()
        self.target = target
        self.published = threading.Event()

    def publish(self) -> None:
        self.counter[0] = self.target
        self.published.set()

    def check(self) -> None:
        """After the step's tokens are in: raise if the device gave up waiting for the masks."""
        if self.counter[1]:
            raise RuntimeError("the device gave up waiting for a grammar step's masks (kernels/host_wait.py)")


class GrammarMasks:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self.counter: torch.Tensor | None = None  # the pinned counter the device polls
        self.queued = 0  # steps given HostMasks so far: each one's counter value
        # One pinned buffer serves every step: a step's masks are filled only after the step before it
        # returned its tokens, so the device has read that step's masks.
        self.on_host: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None  # on the device: where the masking kernel copies rows
        self._loaded: set[tuple] = set()  # the logits layouts the masking kernel has run on

    def host_masks(self, rows: int, words: int) -> HostMasks:
        """Pinned host memory for a grammar step's masks, and the counter value that says they are in."""
        if self.counter is None:
            self.counter = torch.zeros(2, dtype=torch.int64, pin_memory=self.cuda)
        if self.on_host is None or self.on_host.shape[0] < rows:
            self.on_host = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=self.cuda)
        self.queued += 1
        return HostMasks(self.on_host[:rows], self.counter, self.queued)

    def _load_kernel(self, logits: torch.Tensor, index: torch.Tensor, words: int) -> None:
        """Run the masking kernel once for this logits layout with nothing to wait for and nothing to
        mask: the first launch of a kernel variant compiles it and loads its module, and a module load
        waits for the device, so behind a pending wait it would wait for the masks (and until the wait
        gives up if the thread that publishes them needs what the waiting one holds). No wait is pending
        here: the step before this one has returned its tokens."""
        from tokenmill.kernels.host_wait import apply_bitmask_from_host

        assert self.counter is not None
        assert self.on_host is not None
        if self.staging is None or self.staging.shape != self.on_host.shape:
            # Allocated here, where no wait is pending, not with on_host (the step before may still wait).
            self.staging = torch.empty(self.on_host.shape, dtype=torch.int32, device=self.device)
        key = (logits.dtype, logits.stride(0), logits.shape[1], words)
        if key not in self._loaded:
            allowed = torch.full((1, words), -1, dtype=torch.int32, pin_memory=True)
            apply_bitmask_from_host(logits, index[:1], allowed, self.counter, 0, self.staging[:1, :words])
            torch.cuda.synchronize(self.device)
            self._loaded.add(key)

    def apply(self, logits: torch.Tensor, index: torch.Tensor, bitmask: np.ndarray | HostMasks) -> None:
        """-inf at logits row index[i] wherever row i of the masks has a 0 bit. HostMasks: the masks the
        host is still filling; the stream waits for them, then reads them from host memory (on a CPU,
        the host waits)."""
        if isinstance(bitmask, HostMasks) and not self.cuda:
            bitmask.published.wait()
            apply_bitmask(logits, index, bitmask.tensor)
        elif isinstance(bitmask, HostMasks):
            from tokenmill.kernels.host_wait import apply_bitmask_from_host

            assert self.counter is not None
            self._load_kernel(logits, index, bitmask.tensor.shape[1])
            apply_bitmask_from_host(logits, index, bitmask.tensor, self.counter, bitmask.target, self.staging)
        else:
            # Through pinned memory as the step's inputs are: a copy from pageable memory would wait for
            # the forward pass, leaving the host idle instead of planning the next step.
            (mask,) = staged([bitmask], np.int32, self.device)
            apply_bitmask(logits, index, mask)
