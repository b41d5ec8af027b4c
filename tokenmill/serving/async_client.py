"""AsyncEngineClient: an API process's handle on the engine-core process. It starts the core (or, one of
several API processes, attaches to the core its launcher started), sends it requests over ZMQ, and one
asyncio task reads the core's outputs, detokenizes them and hands them to per-request queues. A request
whose consumer goes away is aborted in the core at once, which frees its KV blocks; if the core dies,
every open request fails fast."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.core_link import (
    CoreSockets,
    CoreWatch,
    EngineDeadError,
    EngineOverloadedError,
    connect,
    request_failure,
    spawn_core,
)
from tokenmill.serving.core_protocol import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    message_decoder,
)
from tokenmill.serving.input_processor import InputProcessor
from tokenmill.serving.metrics import ServerMetrics
from tokenmill.serving.output_processor import OutputProcessor
from tokenmill.serving.request_stream import ABORTED, RequestState, stream_outputs
from tokenmill.serving.step_trace import StepTrace

API_TRACE_COLUMNS = ("received_s", "outputs", "process_ms", "longest_wait_ms")

logger = logging.getLogger("tokenmill.server")


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        ready: EngineReady,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        process: multiprocessing.process.BaseProcess | CoreWatch,
        sockets: CoreSockets,
        metrics: ServerMetrics | None,
        hf_config: object = None,
        client_index: int = 0,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        # None when the core generates text; "last" or "mean" when it pools (embeddings only).
        self.pooling_type = ready.pooling_type
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.input_processor = InputProcessor(
            tokenizer, ready.max_model_len, ready.vocab_size, scheduling_policy=config.scheduling_policy
        )
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids)
        self.process = process
        # Only the API process that started the core stops it; one attached to a launcher's core does not.
        self.owns_core = isinstance(process, multiprocessing.process.BaseProcess)
        self.client_index = client_index
        self.metrics = metrics
        self.dead_error: str | None = None
        self._sockets = sockets
        self._requests: dict[str, RequestState] = {}
        self._num_not_started = 0  # admitted requests that have produced no output yet
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._on_dead: list[Callable[[], None]] = []
        self._closing = False
        # TOKENMILL_STEP_TRACE: one row per step's outputs received (when, how many, how long they took
        # to process, the longest any open stream had waited for them).
        self._trace = StepTrace.from_env(API_TRACE_COLUMNS, f".api{client_index}")
        self._decoder = message_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        loop = asyncio.get_running_loop()
        self._output_task = loop.create_task(self._output_loop())
        loop.add_reader(process.sentinel, self._on_core_exit)

    # ---- start and stop ----------------------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig, metrics: ServerMetrics | None = None) -> AsyncEngineClient:
        """Start the engine-core process and wait until its model is loaded."""
        sockets = CoreSockets.bind()
        process = spawn_core(config, sockets)
        try:
            return await cls._connect(config, metrics, sockets, process)
        except BaseException:
            process.kill()
            process.join()
            raise

    @classmethod
    async def attach(
        cls,
        config: EngineConfig,
        metrics: ServerMetrics | None,
        input_address: str,
        output_address: str,
        client_index: int,
        core_pid: int,
    ) -> AsyncEngineClient:
        """Join the engine core a launcher started (`--api-server-count`): bind this API process's pair of
        sockets, which the core connects to, and wait for its model like `start` does."""
        sockets = CoreSockets(input_address, output_address)
        return await cls._connect(config, metrics, sockets, CoreWatch(core_pid), client_index)

    @classmethod
    async def _connect(
        cls,
        config: EngineConfig,
        metrics: ServerMetrics | None,
        sockets: CoreSockets,
        process: multiprocessing.process.BaseProcess | CoreWatch,
        client_index: int = 0,
    ) -> AsyncEngineClient:
        link = await connect(config, sockets, process)
        return cls(
            config, link.ready, link.tokenizer, link.eos_token_ids, process, sockets, metrics, link.hf_config,
            client_index,
        )  # fmt: skip

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (politely, then by force) and release the sockets."""
        if self._closing:
            return
        self._closing = True
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if self.owns_core and self.process.is_alive():
            self._send(Shutdown())
            await asyncio.to_thread(self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("engine core did not stop in %.0f s; killing it", timeout)
                self.process.kill()
                await asyncio.to_thread(self.process.join)
        self._output_task.cancel()
        await asyncio.gather(self._output_task, return_exceptions=True)
        self._sockets.close()
        if self._trace is not None:
            self._trace.write()
        if not self.owns_core:
            self.process.close()

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        self._on_dead.append(callback)

    # ---- requests ----------------------------------------------------------------------------

    @property
    def num_open_requests(self) -> int:
        return len(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        remote_decode: bool = False,
        remote_prefill: RemotePrefill | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Check and submit a request now (errors raise here, before any response starts); returns the
        stream of its outputs. Closing the stream before the request finishes aborts it.

        remote_decode: keep the finished request's KV for a decode peer (a prefill instance);
        remote_prefill: a prefill peer computed the prompt (a decode instance); cache_salt: its prompt
        shares prefix-cache blocks only with requests of the same salt; priority: lower runs earlier
        (under the priority scheduling policy only)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        cap = self.config.max_waiting_requests
        if cap is not None and self._num_not_started >= cap:
            raise EngineOverloadedError(f"the server's waiting queue is full ({cap} requests); retry later.")
        self.input_processor.check(prompt_token_ids, params, priority)
        children = self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, params)
        state = RequestState(time.monotonic(), len(prompt_token_ids))
        self._requests[request_id] = state
        self._num_not_started += 1
        for child_id, child_params in children:
            self._send(
                AddRequest(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    state.arrival_time,
                    self.client_index,
                    remote_decode,
                    [remote_prefill.first_token_id, remote_prefill.kv_address, remote_prefill.transfer_id]
                    if remote_prefill is not None
                    else None,
                    cache_salt,
                    priority,
                )
            )
        return stream_outputs(request_id, state, self.abort)

    def abort(self, request_id: str) -> None:
        """Abort a request in the core now (freeing its blocks) and end its stream; idempotent."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if state.first_output_time is None:
            self._num_not_started -= 1
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self.dead_error is None:
            self._send(AbortRequests(child_ids))
        if self.metrics is not None:
            for _ in child_ids:
                self.metrics.record_finished("abort", None)
        state.queue.put_nowait(ABORTED)

    def abort_all(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call("reset_prefix_cache"))

    async def num_unfinished_in_core(self) -> int:
        return int(await self._call("num_unfinished_requests"))

    async def _call(self, method: str) -> object:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send(UtilityCall(call_id, method, self.client_index))
        return await future

    # ---- the output side ---------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                message = self._decoder.decode(await self._sockets.output.recv())
                if isinstance(message, StepOutputs):
                    self._process_step(message)
                elif isinstance(message, UtilityResult):
                    future = self._utility_calls.pop(message.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(message.result)
                elif isinstance(message, EngineDead):
                    self._fail(f"engine core failed: {message.error_type}: {message.error}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("output processing failed")
            self._fail(f"output processing failed: {type(exc).__name__}: {exc}")

    def _process_step(self, message: StepOutputs) -> None:
        now = time.monotonic()
        waited = self._longest_wait(now) if self._trace is not None else 0.0
        if self.metrics is not None and self.client_index == 0:
            self.metrics.record_stats(message.stats)
        request_outputs, to_abort = self.output_processor.process(message.outputs)
        if to_abort:  # a stop string matched in the text: the core cannot know, so tell it to stop
            self._send(AbortRequests(to_abort))
        gaps: dict[float, int] = {}
        num_tokens = 0
        for output in request_outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            if state.first_output_time is None:
                state.first_output_time = now
                self._num_not_started -= 1
                if self.metrics is not None:
                    self.metrics.record_first_token(now - state.arrival_time, state.num_prompt_tokens)
            elif state.last_output_time is not None:
                gap = now - state.last_output_time
                gaps[gap] = gaps.get(gap, 0) + 1
            state.last_output_time = now
            for completion in output.outputs:
                num_tokens += len(completion.delta_token_ids)
            if output.finished:
                del self._requests[output.request_id]
                if self.metrics is not None:
                    for completion in output.outputs:
                        reason = completion.finish_reason or "abort"
                        self.metrics.record_finished(
                            reason, now - state.arrival_time, state.num_prompt_tokens,
                            len(completion.token_ids), now - state.first_output_time,
                        )  # fmt: skip
            failure = output.error if output.finished else None  # a KV transfer's, or a grammar's
            if state.queued_since is None:
                state.queued_since = now
            state.queue.put_nowait(request_failure(failure) if failure is not None else output)
        if self.metrics is not None:
            self.metrics.record_step(gaps, num_tokens)
        if self._trace is not None:
            self._trace.add(now, len(message.outputs), (time.monotonic() - now) * 1e3, waited * 1e3)

    def _longest_wait(self, now: float) -> float:
        """For the step trace: the longest any open stream has waited since its last output."""
        waits = (now - r.last_output_time for r in self._requests.values() if r.last_output_time is not None)
        return max(waits, default=0.0)

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        # The sentinel fires as the process ends, a moment before it can be reaped for its exit code.
        self.process.join(timeout=0.5)
        if not self._closing:
            code = "unknown" if self.process.exitcode is None else self.process.exitcode
            self._fail(f"engine core process died unexpectedly (exit code {code}).")

    def _fail(self, error: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        logger.error("%s Failing %d open requests.", error, len(self._requests))
        for state in self._requests.values():
            state.queue.put_nowait(EngineDeadError(error))
        self._requests.clear()
        self._num_not_started = 0
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(error))
        self._utility_calls.clear()
        for callback in self._on_dead:
            callback()

    def _send(self, message: object) -> None:
        try:
            # Never block the event loop: with the core gone a PUSH socket would wait forever.
            self._sockets.input.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            if not self._closing:
                self._fail("engine core is not reading its input socket.")
