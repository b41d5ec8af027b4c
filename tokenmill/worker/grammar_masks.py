"""Grammar masks onto a step's logits: rows the host filled before the step samples (staged with the
step's inputs), or rows in pinned memory the host fills after the sampling is queued, which the stream
waits for (HostMasks; kernels/host_wait.py)."""

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
        # returned its tokens, so the copy of that step's masks has run. The device's copy is kept too, so
        # that queueing behind a pending wait does not allocate (a cudaMalloc waits for the wait).
        self.on_host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None

    def host_masks(self, rows: int, words: int) -> HostMasks:
        """Pinned host memory for a grammar step's masks, and the counter value that says they are in."""
        if self.counter is None:
            self.counter = torch.zeros(2, dtype=torch.int64, pin_memory=self.cuda)
            if self.cuda:
                self._load_kernels(words)
        if self.on_host is None or self.on_host.shape[0] < rows:
            shape = (max(rows, 64), words)
            self.on_host = torch.empty(shape, dtype=torch.int32, pin_memory=self.cuda)
            if self.cuda:
                self.on_device = torch.empty(shape, dtype=torch.int32, device=self.device)
        self.queued += 1
        return HostMasks(self.on_host[:rows], self.counter, self.queued)

    @torch.inference_mode()
    def _load_kernels(self, words: int) -> None:
        """Run the kernels a grammar step queues behind its wait once, with no wait pending: a kernel's
        first launch loads its module, which waits for the device, so behind a pending wait it would
        wait for the masks (and until the wait gives up if the thread that publishes them needs what
        the waiting one holds)."""
        from tokenmill.kernels.host_wait import wait_for_host

        assert self.counter is not None
        wait_for_host(self.counter, 0)
        logits = torch.zeros((1, 32 * words), dtype=self.dtype, device=self.device)
        mask = torch.zeros((1, words), dtype=torch.int32, pin_memory=True).to(self.device, non_blocking=True)
        apply_bitmask(logits, torch.zeros(1, dtype=torch.int64, device=self.device), mask)
        torch.cuda.synchronize(self.device)

    def apply(self, logits: torch.Tensor, index: torch.Tensor, bitmask: np.ndarray | HostMasks) -> None:
        """-inf at logits row index[i] wherever row i of the masks has a 0 bit. HostMasks: the masks the
        host is still filling; the stream waits for them before copying them in (on a CPU, the host)."""
        if isinstance(bitmask, HostMasks) and not self.cuda:
            bitmask.published.wait()
            mask = bitmask.tensor
        elif isinstance(bitmask, HostMasks):
            from tokenmill.kernels.host_wait import wait_for_host

            assert self.counter is not None and self.on_device is not None
            wait_for_host(self.counter, bitmask.target)
            mask = self.on_device[: bitmask.tensor.shape[0]]
            mask.copy_(bitmask.tensor, non_blocking=True)
        else:
            # Through pinned memory as the step's inputs are: a copy from pageable memory would wait for
            # the forward pass, leaving the host idle instead of planning the next step.
            (mask,) = staged([bitmask], np.int32, self.device)
        apply_bitmask(logits, index, mask)
