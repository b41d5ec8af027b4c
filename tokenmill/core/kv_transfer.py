"""Prefill/decode disaggregation as the scheduler keeps it (ints and bytes; the copies are the worker's
BlockRows, the network the engine-core process's, serving/kv_transfer.py).

Prefill side: a request sent with `remote_decode` runs as usual (its prompt, one sampled token), and
when it finishes its blocks are held instead of freed, under its request id as the transfer id, until
the decode instance has fetched them (or gives up, or a deadline passes).

Decode side: a request that arrives with `remote_prefill` (the prefill peer's first token and where its
KV waits) never computes its prompt. It waits, outside the ordinary queue, for blocks to hold its
prompt; once it has them the engine-core process fetches the KV, and the step after it arrives copies
it into those blocks ahead of the forward pass and computes the request's first output token's
position: the request then decodes like any other."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.core.kv_cache import KVCacheManager, cdiv
from tokenmill.core.request import Request


@dataclass
class RemotePrefill:
    """What a decode instance knows of a request a prefill peer computed."""

    first_token_id: int
    kv_address: str  # the peer's KV endpoint
    transfer_id: str  # the peer's request id


class KVTransfers:
    def __init__(self, kv: KVCacheManager, hold_s: float = 120.0) -> None:
        self.kv = kv
        self.hold_s = hold_s
        # Prefill side: transfer id -> (finished request whose blocks wait to be fetched, deadline).
        self.held: OrderedDict[str, tuple[Request, float]] = OrderedDict()
        # Decode side, in arrival order: requests waiting for blocks, then for their KV.
        self.awaiting: OrderedDict[str, Request] = OrderedDict()
        self.to_fetch: list[Request] = []  # given blocks since the engine core last looked
        self.arrived: dict[str, bytes] = {}

    # ---- prefill side -----------------------------------------------------------------------

    def hold(self, request: Request) -> None:
        self.held[request.request_id] = (request, time.monotonic() + self.hold_s)

    def held_blocks(self, transfer_id: str) -> list[int] | None:
        """The blocks that hold the prompt's KV (its last position's included), or None if unknown."""
        entry = self.held.get(transfer_id)
        if entry is None:
            return None
        request = entry[0]
        return request.block_ids[: cdiv(request.num_prompt_tokens, self.kv.block_size)]

    def release(self, transfer_id: str) -> None:
        entry = self.held.pop(transfer_id, None)
        if entry is not None:
            self.kv.free(entry[0])

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [tid for tid, (_, deadline) in self.held.items() if deadline <= now]
        for transfer_id in expired:
            self.release(transfer_id)
        return expired

    # ---- decode side ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.awaiting[request.request_id] = request

    def reserve(self) -> None:
        """Blocks for the prompts of waiting requests, in arrival order, while memory allows: the KV
        lands in them, and the first output token's position with it."""
        for request in self.awaiting.values():
            if request.block_ids:
                continue
            if self.kv.allocate_slots(request, request.num_prompt_tokens + 1) is None:
                return
            self.to_fetch.append(request)

    def take_to_fetch(self) -> list[Request]:
        requests, self.to_fetch = self.to_fetch, []
        return requests

    def deliver(self, request_id: str, data: bytes) -> None:
        if request_id in self.awaiting:
            self.arrived[request_id] = data

    def ready(self, limit: int) -> list[tuple[Request, bytes]]:
        """Up to `limit` requests whose KV has arrived, in arrival order (taken out of the waiting set);
        the rest stay for a later step."""
        out = []
        for request_id in [r for r in self.awaiting if r in self.arrived][: max(limit, 0)]:
            out.append((self.awaiting.pop(request_id), self.arrived.pop(request_id)))
        return out

    def forget(self, request_id: str) -> Request | None:
        """A waiting request finished (aborted, timed out): it leaves the set."""
        self.arrived.pop(request_id, None)
        self.to_fetch = [r for r in self.to_fetch if r.request_id != request_id]
        return self.awaiting.pop(request_id, None)
