"""The OpenAI request bodies of chat and completions as pydantic models whose field constraints turn every
out-of-range parameter into a 400 naming the parameter, plus the conversion to SamplingParams. Responses
are plain dicts; the bodies of /tokenize, /detokenize and /v1/embeddings are in tokenize_embed_protocol.py."""

from __future__ import annotations

from functools import cached_property
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

from .constraints import GUIDED_KINDS, given_constraints, one_constraint
from .errors import ParamError
from .tool_calls import check_tools

_MAX_LOGPROBS = 20
_SEED_RANGE = dict(ge=-(2**63), le=2**63 - 1)
# vLLM's request extras this server does not implement, each with the values that ask for nothing: any
# other value is a 400 naming the field, not an answer that differs from vLLM's without a word.
_UNSUPPORTED_EXTRAS = {
    "use_beam_search": (False,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
}  # fmt: skip


class OpenAIModel(BaseModel):
    # OpenAI clients send fields this server does not use (user, metadata, store...): ignore them.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        """OpenAI's schema lets a client send null for an optional field (`"n": null`, as LangChain and
        litellm do): null means the field's default. A required field sent as null is still missing."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].default is None
        }


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class SamplingFields(OpenAIModel):
    """The sampling knobs shared by chat and completions, with vLLM's extras (top_k ... stop_token_ids)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    unsupported_extras: ClassVar[dict[str, tuple]] = _UNSUPPORTED_EXTRAS
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None (or null): the default, else 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, **_SEED_RANGE)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # None (unset or null): the server's default, the generation config's value where it has one.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these may be sampled
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt shares prefix-cache blocks only with requests of the same salt (one tenant's
    # cached prompts cannot be probed by another's timing).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: lower runs earlier; anything but 0 needs a server started with --scheduling-policy priority.
    priority: int = 0
    # vLLM's: each prompt token's logprob, rank and top k alternatives (None for the first token);
    # completions report them per choice, chat beside the choices, a stream never.
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's response_format; as vLLM takes them, one object or the older guided_*
    # fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # vLLM's: the whitespace_pattern of the guided_* JSON

    def constraints(self) -> list[tuple[str, dict]]:
        """(request field, StructuredOutputsParams fields) for every constraint the request gives."""
        guided = {kind: getattr(self, f"guided_{kind}") for kind in GUIDED_KINDS}
        return given_constraints(self.response_format, self.structured_outputs, guided)

    @cached_property
    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request's one constraint and the field it came from; ParamError for two or a bad one."""
        return one_constraint(self.constraints(), self.guided_whitespace_pattern)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_extras(cls, data: object) -> object:
        for name, idle_values in cls.unsupported_extras.items():
            if isinstance(data, dict) and data.get(name, idle_values[0]) not in idle_values:
                raise ParamError(name, f"{name} is not supported by this server")
        return data

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingFields:
        for token_id, bias in (self.logit_bias or {}).items():
            if not token_id.lstrip("-").isdigit():
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
            if not -100 <= bias <= 100:
                raise ParamError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}"
                )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not s for s in stops):
            raise ParamError("stop", "stop strings must not be empty")
        if len(stops) > 16:
            raise ParamError("stop", f"at most 16 stop strings, got {len(stops)}")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        self._check_prompt_logprobs()
        self.constraint  # noqa: B018 (raises ParamError for a bad or second output constraint)
        return self

    def _check_prompt_logprobs(self) -> None:
        k = self.prompt_logprobs
        if k is None:
            return
        if self.stream and k != 0:  # vLLM's rule and words; 0 asks for nothing a stream would carry
            raise ParamError("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
        if k == -1:
            raise ParamError(
                "prompt_logprobs",
                f"prompt_logprobs=-1 (the whole vocabulary) is not supported: at most {_MAX_LOGPROBS}",
            )
        if not 0 <= k <= _MAX_LOGPROBS:
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {k}")
        if self.stream:
            self.prompt_logprobs = None

    def _check_min_tokens(self, max_tokens: int | None, max_field: str) -> None:
        """min_tokens over the max_tokens a request gives is a 400, as vLLM's; over the room a prompt
        leaves (no max_tokens given), it is capped there."""
        if max_tokens and self.min_tokens > max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens ({self.min_tokens}) is over {max_field} ({max_tokens})"
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """As vLLM reads stream_options: continuous_usage_stats counts only beside include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, float | int] | None = None,
    ) -> SamplingParams:
        """defaults: the server's (generation_config.py), for the knobs this request leaves unset."""
        defaults = defaults or {}

        def knob(name: str, neutral: float) -> float:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=knob("temperature", 1.0),
            top_p=knob("top_p", 1.0),
            top_k=int(knob("top_k", 0)),
            min_p=knob("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=knob("repetition_penalty", 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint[1] if (constraint := self.constraint) else None,
        )


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool result's call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: object) -> object:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: the served model reads text "
                        "only; send the content as a string or as parts of type 'text'"
                    )
        return content

    @field_validator("tool_calls")
    @classmethod
    def _calls_name_functions(cls, calls: list[dict] | None) -> list[dict] | None:
        """An assistant's calls as OpenAI writes them: {"id", "type": "function", "function": {"name",
        "arguments"}}; the chat template reads each one's function name and arguments."""
        for index, call in enumerate(calls or []):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"tool_calls.{index}.function must be an object with the function's name")
            if not isinstance(function.get("arguments"), str | dict):
                raise ValueError(f"tool_calls.{index}.function.arguments must be the arguments' JSON text")
        return calls

    @model_validator(mode="after")
    def _tool_results_name_their_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs the tool_call_id of the call it answers")
        return self

    def template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM joins them
        # Templates written before the "developer" role know it as "system".
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.name is not None:  # a participant's name, for the templates that write it
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    unsupported_extras: ClassVar[dict[str, tuple]] = {**_UNSUPPORTED_EXTRAS, "echo": (None, False)}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's chat template extras: the last (assistant) message continued rather than closed, a template
    # of the request's own, more variables for the template (Qwen3's enable_thinking, ...).
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    # vLLM's: special tokens (a BOS) added on top of what the chat template writes; off by default.
    add_special_tokens: bool = False
    tools: list | None = None
    tool_choice: str | dict | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message",
                "continue_final_message continues the last message: set add_generation_prompt to false",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParamError("continue_final_message", "the last message must be the assistant's to continue")
        max_field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        self._check_min_tokens(self.requested_max_tokens, max_field)
        check_tools(self.tools, self.tool_choice)
        if self.tool_mode in ("required", "named") and self.constraints():
            raise ParamError(
                "tool_choice",
                "a required or named tool_choice constrains the output itself: drop response_format",
            )
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (a function given in tool_choice)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # true/false are not token ids
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt, generate nothing
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS (where the tokenizer adds one)
    # Disaggregation: {"do_remote_decode": true} from a decode peer (served with --kv-role prefill).
    kv_transfer_params: dict | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError(
                "max_tokens", "max_tokens=0 generates nothing; it is only allowed with echo=true (scoring)"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(
                "best_of", "best_of must equal n (beam search and best-of ranking are not supported)"
            )
        self._check_min_tokens(self.max_tokens, "max_tokens")
        if isinstance(self.prompt, list) and (
            not self.prompt or any(p == [] or p == "" for p in self.prompt)
        ):
            raise ParamError("prompt", "prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]
