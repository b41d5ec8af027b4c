"""Checks and tokenizes a request before it reaches the engine core, so bad input fails alone, early,
with an error that names the knob."""

from __future__ import annotations

from tokenmill.sampling_params import KnobError, SamplingParams
from tokenmill.serving.prompt import render_prompt
from tokenmill.structured_outputs import StructuredOutputs


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        structured: StructuredOutputs | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        """structured: the engine core's, when it runs in this process (its compiled constraints then
        serve both); else one of this process's own. scheduling_policy: the engine's (a priority other
        than 0 needs "priority")."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scheduling_policy = scheduling_policy
        # Compiles each new output constraint once, so a bad one fails here, not in the engine core.
        if structured is None and tokenizer is not None:
            structured = StructuredOutputs(lambda: tokenizer, vocab_size)
        self.structured = structured

    def check_structured(self, params: SamplingParams) -> None:
        """A request's output constraint compiles against this tokenizer (cached by its text)."""
        if params.structured_outputs is None:
            return
        if self.structured is None:
            raise ValueError("structured_outputs needs the model's tokenizer (skip_tokenizer_init is set).")
        constraint = params.structured_outputs
        self.structured.compiled(constraint)
        # allowed_token_ids apart from every token the request may start with: it could only sample a
        # token its grammar refuses (and fail).
        if params.allowed_token_ids is not None:
            first = self.structured.first_tokens(constraint)
            if first is not None and not any(first[t] for t in params.allowed_token_ids if t < len(first)):
                raise KnobError(
                    "allowed_token_ids",
                    "allowed_token_ids holds none of the tokens the output constraint allows first.",
                )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return render_prompt(self.tokenizer, prompt).token_ids

    def check(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        if priority != 0 and self.scheduling_policy != "priority":  # vLLM's rule and its 400
            raise KnobError(
                "priority",
                f"Got priority {priority} but priority scheduling is not enabled: start the engine with "
                "--scheduling-policy priority (LLM(scheduling_policy='priority')).",
            )
        if not prompt_token_ids:
            raise KnobError("prompt", "prompt must not be empty.")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise KnobError(
                "prompt", f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}."
            )
        if len(prompt_token_ids) > self.max_model_len:
            raise KnobError(
                "prompt",
                f"prompt is {len(prompt_token_ids)} tokens, longer than max_model_len={self.max_model_len}.",
            )
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise KnobError(
                    "logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad[:5]}."
                )
        if params.allowed_token_ids:
            bad = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if bad:
                raise KnobError(
                    "allowed_token_ids",
                    f"allowed_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}.",
                )
        if params.stop and self.tokenizer is None:
            raise KnobError("stop", "stop strings need the model's tokenizer (skip_tokenizer_init is set).")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise KnobError(
                "stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}."
            )
        self.check_structured(params)

    def process(self, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> list[int]:
        prompt_token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # the last k tokens, as vLLM keeps them
            keep = (
                self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            )
            prompt_token_ids = prompt_token_ids[-keep:]
        self.check(prompt_token_ids, params, priority)
        return prompt_token_ids
