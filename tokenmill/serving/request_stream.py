"""One request's side of the API process: its state (arrival, first and last output, the queue the output
loop fills) and the stream its HTTP handler reads, which hands outputs that queued up while the handler
was busy over as one, and logs long gaps between chunks with where the time went."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenmill.outputs import RequestOutput
from tokenmill.serving.output_processor import merge_outputs

logger = logging.getLogger("tokenmill.server")
# A stream's chunks this far apart are logged with where the time went (a stream at 100 tokens/s has
# missed ten tokens).
STREAM_GAP_LOG_S = 0.1


class Aborted:
    """Queue marker: the request was aborted (client gone, drain timeout), so its stream just ends."""


ABORTED = Aborted()


@dataclass
class RequestState:
    arrival_time: float
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_output_time: float | None = None
    last_output_time: float | None = None
    queued_since: float | None = None  # when the oldest output not yet handed to the stream arrived


async def stream_outputs(
    request_id: str, state: RequestState, abort: Callable[[str], None]
) -> AsyncIterator[RequestOutput]:
    """The outputs of one request as its handler reads them; closing it before the request finishes
    calls abort(request_id)."""
    finished = False
    held = None  # a marker met while merging, handled on the next turn
    handed = sent_s = None  # when the last chunk went to the HTTP layer, how long it took back
    try:
        while True:
            item = held if held is not None else await state.queue.get()
            held = None
            if isinstance(item, BaseException):
                raise item
            if item is ABORTED:
                return
            # Outputs that queued up while this stream's consumer was busy go out as one: a
            # front end that falls behind sends fewer, larger chunks instead of falling further.
            while not item.finished and not state.queue.empty():
                following = state.queue.get_nowait()
                if not isinstance(following, RequestOutput):
                    held = following
                    break
                item = merge_outputs(item, following)
            finished = item.finished
            now = time.monotonic()
            if handed is not None and now - handed >= STREAM_GAP_LOG_S:
                gap, waited = now - handed, now - (state.queued_since or now)
                # At info when this process made most of the gap; a long engine step (a big prompt
                # chunk, a CPU engine) makes such gaps on every stream, and is only worth a debug line.
                level = logging.INFO if max(waited, sent_s or 0.0) >= gap / 2 else logging.DEBUG
                logger.log(
                    level, "stream %s: %.0f ms between chunks: its outputs waited %.0f ms here, the "
                    "chunk before took %.0f ms to send (if neither is long, the engine core sent late)",
                    request_id, gap * 1e3, waited * 1e3, (sent_s or 0.0) * 1e3,
                )  # fmt: skip
            state.queued_since = None
            yield item
            handed, sent_s = now, time.monotonic() - now
            if finished:
                return
    finally:
        if not finished:
            abort(request_id)
