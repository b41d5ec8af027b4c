"""The request bodies of the endpoints that generate no text: vLLM's /tokenize and /detokenize, OpenAI's
/v1/embeddings; on the base model of chat and completions (protocol.py), so their errors read alike."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .errors import ParamError
from .protocol import ChatMessage, OpenAIModel
from .tool_calls import check_tools

_MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on the items of one embeddings request


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages with the chat completion's template knobs, so a chat's
    count here is its prompt_tokens there."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message",
                "continue_final_message continues the last message: set add_generation_prompt to false",
            )
        check_tools(self.tools, None)
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's extra: keep the last k tokens

    @model_validator(mode="after")
    def _check_input(self) -> EmbeddingRequest:
        if self.input == "" or (
            isinstance(self.input, list) and (not self.input or any(i == [] or i == "" for i in self.input))
        ):
            raise ParamError("input", "input must not be empty")
        many = isinstance(self.input, list) and self.input and not isinstance(self.input[0], int)
        if many and len(self.input) > _MAX_EMBEDDING_INPUTS:
            raise ParamError(
                "input", f"input has {len(self.input)} items; at most {_MAX_EMBEDDING_INPUTS} per request"
            )
        return self

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]
