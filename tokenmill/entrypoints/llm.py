"""The offline API: `LLM(model=...)`, then `generate` or `chat` over many prompts at once."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.generation_config import default_sampling_params, describe
from tokenmill.gc_pauses import freeze_startup
from tokenmill.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams, pooling_request_params
from tokenmill.serving.chat_encoder import ChatEncoder
from tokenmill.serving.llm_engine import LLMEngine
from tokenmill.serving.prompt import Message, render_prompt
from tokenmill.thinking import check_reasoning_tokens, prompt_thinking

logger = logging.getLogger("tokenmill.llm")


class LLM:
    def __init__(self, model: str | None = "default", **engine_options) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        self._default_sampling = default_sampling_params(self.config)  # a bad value fails before loading
        if self._default_sampling:
            logger.info(describe(self._default_sampling))
        self.engine = LLMEngine(self.config)
        check_reasoning_tokens(self.config.reasoning_parser, self.engine.tokenizer, "reasoning_parser")
        # The model and the engine live as long as this LLM: frozen until it is dropped (__del__).
        freeze_startup()
        self._request_counter = itertools.count()
        # chat() tokenizes conversations from cached pieces: a shared system prompt once.
        tokenizer = self.engine.tokenizer
        self._chat_encoder = ChatEncoder(tokenizer) if tokenizer is not None else None

    def __del__(self) -> None:
        # Thawed, the engine's reference cycles can be collected again: its model's memory comes back at
        # the next full collection, not at exit. (The thaw is the whole process's: another LLM still
        # alive is walked by full collections again until it is rebuilt or dropped.)
        gc.unfreeze()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine under this LLM."""
        return self.engine

    def _after_thinking(self, params: SamplingParams) -> SamplingParams:
        return _constraint_after_thinking(params, self.config.reasoning_parser)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no sampling_params: SamplingParams' own defaults under
        the generation config's (the model's generation_config.json unless generation_config='vllm')."""
        return SamplingParams(**self._default_sampling)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order. use_tqdm: a
        progress bar, or a tqdm-like class to draw it with. lora_request: only None (no LoRA here)."""
        if self.engine.pooling_type is not None:
            raise ValueError("this engine runs the pooling runner (runner='pooling'): use LLM.embed.")
        _refuse_lora(lora_request)
        return self._submit(prompts, prompt_token_ids, sampling_params, use_tqdm, priority)

    def embed(
        self,
        prompts: str | Sequence[str] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        truncate_prompt_tokens: int | None = None,
        pooling_params: None = None,
        lora_request: None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One L2-normalised embedding per prompt (output.outputs.embedding, as vLLM's), in prompt order;
        needs an engine with runner='pooling' (the default for bare-model checkpoints such as
        Qwen3Model). truncate_prompt_tokens: embed each prompt's last k tokens. pooling_params and
        lora_request: only None (the engine's pooling, no LoRA)."""
        pooled = self._pool(
            prompts, prompt_token_ids, use_tqdm, truncate_prompt_tokens, pooling_params, lora_request
        )
        return [EmbeddingRequestOutput.from_output(output) for output in pooled]

    def encode(
        self,
        prompts: str | Sequence[str] | None = None,
        pooling_params: None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's pooling call: embed's vectors as tensors (output.outputs.data). pooling_task: "embed" or
        None, the one task this engine pools for."""
        if pooling_task not in (None, "embed"):
            raise ValueError(
                f"pooling_task must be 'embed' (the only task here) or None, got {pooling_task!r}."
            )
        pooled = self._pool(
            prompts, prompt_token_ids, use_tqdm, truncate_prompt_tokens, pooling_params, lora_request
        )
        return [PoolingRequestOutput.from_output(output) for output in pooled]

    def _pool(
        self, prompts, prompt_token_ids, use_tqdm, truncate_prompt_tokens, pooling_params, lora_request
    ) -> list[RequestOutput]:
        """embed's and encode's requests: every prompt pooled, outputs in prompt order."""
        if self.engine.pooling_type is None:
            raise ValueError("embed needs runner='pooling'; this engine generates text.")
        if pooling_params is not None:
            raise ValueError("pooling_params is not supported: the engine pools as its pooling_type says.")
        _refuse_lora(lora_request)
        params = pooling_request_params(truncate_prompt_tokens)
        return self._submit(prompts, prompt_token_ids, params, use_tqdm, None)

    def _submit(self, prompts, prompt_token_ids, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids.")
        inputs: list[str | list[int]]
        salts: list[str | None]
        if prompts is not None:
            one = isinstance(prompts, (str, dict)) or _is_token_ids(prompts)
            given = [_prompt_input(p) for p in ([prompts] if one else prompts)]
            inputs, salts = [g[0] for g in given], [g[1] for g in given]
        else:
            batch = [prompt_token_ids] if _is_token_ids(prompt_token_ids) else prompt_token_ids
            inputs, salts = [list(ids) for ids in batch], [None] * len(batch)
        params_list = [
            self._after_thinking(p) for p in self._per_prompt(sampling_params, len(inputs), "sampling_params")
        ]
        priorities = list(priority) if priority is not None else [0] * len(inputs)
        if len(priorities) != len(inputs):
            raise ValueError(f"priority has {len(priorities)} entries for {len(inputs)} prompts.")
        # Tokenize and check everything first, so a bad prompt leaves nothing half-submitted.
        token_ids = [
            self.engine.input_processor.process(p, params, prio)
            for p, params, prio in zip(inputs, params_list, priorities)
        ]
        request_ids = []
        for prompt, ids, params, prio, salt in zip(inputs, token_ids, params_list, priorities, salts):
            request_id = str(next(self._request_counter))
            text = prompt if isinstance(prompt, str) else None
            self.engine.add_request(
                request_id, ids, params, priority=prio, prompt_text=text, final_only=True, cache_salt=salt
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate (vLLM's
        arguments, in its order). tools: OpenAI-style function tools the template renders (or a system
        message describes). chat_template_kwargs: more variables for the template (Qwen3's
        enable_thinking, ...). chat_template_content_format: "auto" or "string" joins a message's
        OpenAI-style text parts into one string, as vLLM does for a text-only model; "openai" passes the
        parts to the template as they are. A constraint under a reasoning parser
        (StructuredOutputsParams.reasoning) follows what the rendered prompt did with the thinking: opened
        it (held back until `</think>`) or closed it (applied from the first token)."""
        _refuse_lora(lora_request)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                "chat_template_content_format must be 'auto', 'string' or 'openai', "
                f"got {chat_template_content_format!r}."
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template_content_format != "openai":
            conversations = [[_text_content(m) for m in conversation] for conversation in conversations]
        rendered = [
            render_prompt(
                self.engine.tokenizer,
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                encode=self._chat_encoder.encode if self._chat_encoder is not None else None,
                template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        params_list = self._per_prompt(sampling_params, len(rendered), "sampling_params")
        outputs = self.generate(
            prompt_token_ids=[r.token_ids for r in rendered],
            sampling_params=[
                _thinking_as_prompted(self._after_thinking(p), r.text, c)
                for p, r, c in zip(params_list, rendered, conversations)
            ],
            use_tqdm=use_tqdm,
        )
        for output, prompt in zip(outputs, rendered):
            output.prompt = prompt.text
        return outputs

    def _per_prompt(self, params, count: int, knob: str) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"{knob} has {len(params)} entries for {count} prompts.")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        progress = use_tqdm if callable(use_tqdm) else tqdm
        with progress(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished.")
        return [finished[request_id] for request_id in request_ids]


def _constraint_after_thinking(params: SamplingParams, reasoning_parser: str | None) -> SamplingParams:
    """Under LLM(reasoning_parser=...), a request's output constraint applies after the thinking, as the
    server's does (StructuredOutputsParams.reasoning; one the caller set is kept)."""
    constraint = params.structured_outputs
    if reasoning_parser is None or constraint is None or constraint.reasoning is not None:
        return params
    params = params.clone()
    params.structured_outputs = dataclasses.replace(constraint, reasoning=reasoning_parser)
    return params


def _thinking_as_prompted(params: SamplingParams, prompt: str | None, conversation) -> SamplingParams:
    """A constraint held back while the model thinks (StructuredOutputsParams.reasoning) follows what the
    chat template did: opened the thinking, or closed it (prompt_thinking); else the parser's rule."""
    constraint = params.structured_outputs
    thinking = prompt_thinking(prompt, conversation)
    if constraint is None or constraint.reasoning is None or thinking is None:
        return params
    params = params.clone()
    params.structured_outputs = dataclasses.replace(constraint, prompt_thinking=thinking)
    return params


def _refuse_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: tokenmill serves no LoRA adapters.")


def _is_token_ids(prompt) -> bool:
    """A flat list of ints: one prompt's token ids (vLLM takes them as one prompt, not a batch)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _text_content(message: Message) -> Message:
    """A message whose content is OpenAI-style parts, with its text parts joined by newlines (vLLM's
    "string" content format); other parts are refused (the model reads text only)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content]
    if any(kind != "text" for kind in kinds):
        raise ValueError(
            f"message content parts must be of type 'text' (the model reads text only), got {kinds}."
        )
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _prompt_input(prompt) -> tuple[str | list[int], str | None]:
    """A prompt as generate takes it, and its cache salt: text (or token ids), or vLLM's dict forms
    {"prompt": text} and {"prompt_token_ids": [...]}, either with a "cache_salt" (its prompt then shares
    prefix-cache blocks only with prompts of the same salt)."""
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a prompt's cache_salt must be a non-empty string, got {salt!r}.")
        keys = set(prompt) - {"cache_salt"}
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], salt
        if keys == {"prompt_token_ids"}:
            return list(prompt["prompt_token_ids"]), salt
        raise ValueError(
            "a prompt given as a dict takes one key, 'prompt' (text) or 'prompt_token_ids', and optionally "
            f"'cache_salt', got {sorted(prompt)}."
        )
    if isinstance(prompt, (list, tuple)):  # token ids
        return list(prompt), None
    if not isinstance(prompt, str):
        raise ValueError(
            "prompts are text, token ids or vLLM's dicts ({'prompt': ...}, {'prompt_token_ids': ...}), "
            f"got {type(prompt).__name__}."
        )
    return prompt, None
