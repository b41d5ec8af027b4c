"""Grammar masks onto a step's logits: rows the host filled before the step samples (staged with the
step's inputs), or rows in pinned memory the host fills after the sampling is queued, which the stream
waits for (HostMasks; kernels/host_wait.py)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.structured_outputs import apply_bitmask
from tokenmill.worker.device import staged
from tokenmill.worker.step_output import HostMasks


class GrammarMasks:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self.counter: torch.Tensor | None = None  # the pinned counter the device polls
        self.queued = 0  # steps given HostMasks so far: each one's counter value
        # Kept, so that queueing behind a pending wait does not allocate (a cudaMalloc waits for it).
        self.on_device: torch.Tensor | None = None

    def host_masks(self, rows: int, words: int) -> HostMasks:
        """Pinned host memory for a grammar step's masks, and the counter value that says they are in."""
        if self.counter is None:
            self.counter = torch.zeros(2, dtype=torch.int64, pin_memory=self.cuda)
            if self.cuda:
                self._load_kernels(words)
        self.queued += 1
        tensor = torch.empty((rows, words), dtype=torch.int32, pin_memory=self.cuda)
        return HostMasks(tensor, self.counter, self.queued)

    @torch.inference_mode()
    def _load_kernels(self, words: int) -> None:
        """Run the kernels a grammar step queues behind its wait once, with no wait pending: a kernel's
        first launch loads its module, which waits for the device, so behind a pending wait it would
        wait for the masks (and for ever if the thread that publishes them needs what it holds)."""
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

            assert self.counter is not None
            wait_for_host(self.counter, bitmask.target)
            rows, words = bitmask.tensor.shape
            if self.on_device is None or self.on_device.shape[0] < rows:
                self.on_device = torch.empty((max(rows, 64), words), dtype=torch.int32, device=self.device)
            mask = self.on_device[:rows, :words]
            mask.copy_(bitmask.tensor, non_blocking=True)
        else:
            # Through pinned memory as the step's inputs are: a copy from pageable memory would wait for
            # the forward pass, leaving the host idle instead of planning the next step.
            (mask,) = staged([bitmask], np.int32, self.device)
        apply_bitmask(logits, index, mask)
