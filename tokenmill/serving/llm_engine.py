"""LLMEngine: input processing, the engine core and output processing in one process, stepped by the
caller. The offline `LLM` uses it directly; the server runs the core in its own process instead."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.engine_setup import create_engine
from tokenmill.serving.input_processor import InputProcessor
from tokenmill.serving.output_processor import OutputProcessor


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = create_engine(config)
        self.core, self.runner, self.source = parts.core, parts.runner, parts.source
        self.max_model_len = parts.max_model_len
        self.num_kv_blocks = parts.num_kv_blocks
        self.pooling_type = parts.pooling_type
        self.tokenizer = None if config.skip_tokenizer_init else self.source.load_tokenizer()
        self.eos_token_ids = self.source.eos_token_ids(self.tokenizer)
        structured = self.core.scheduler.structured
        if structured is not None:  # the tokenizer is loaded already
            structured.load_tokenizer = lambda: self.tokenizer
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.source.hf_config.vocab_size, structured,
            config.scheduling_policy,
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)

    @property
    def scheduler(self):
        return self.core.scheduler

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        prompt_text: str | None = None,
        final_only: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """final_only: step() returns the request's output once, when it has finished (the offline
        LLM's generate reads no other). cache_salt: the prompt shares prefix-cache blocks only with
        requests of the same salt."""
        prompt_token_ids = self.input_processor.process(prompt, params, priority)
        text = prompt if isinstance(prompt, str) else prompt_text
        for child_id, child_params in self.output_processor.add_request(
            request_id, text, prompt_token_ids, params, final_only
        ):
            self.core.add_request(
                Request(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    priority=priority,
                    cache_salt=cache_salt,
                )  # fmt: skip
            )

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one turn of the engine core's loop and turn the tokens it returns into outputs.

        With async scheduling the next step is already on the device while this detokenizes; a request
        that a stop string ends here may have one more token computed, which is dropped.
        """
        outputs, to_abort = self.output_processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs
