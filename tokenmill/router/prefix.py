"""A request's prompt as the chain of block hashes the engine's prefix cache keys it by: the chat
template rendered and tokenized as the server does (serving/prompt.py), cut into full blocks of
`block_size` tokens, each hashed over its parent's hash (core/kv_cache.py). Without the model's
tokenizer (routing to servers of another model or engine) the prompt's text is cut into blocks of
characters instead: the hashes then match nothing in the engine, but equal prefixes still hash alike,
which is all routing needs."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenmill.core.kv_cache import hash_block, root_hash
from tokenmill.serving.chat_encoder import ChatEncoder

# Characters per block when hashing text: about 16 tokens of English.
TEXT_BLOCK_CHARS = 64


def chain(items: Sequence, block_size: int, cache_salt: str | None = None) -> list[int]:
    """Hashes of the full blocks of `items`, each chained to the one before, as the engine's (a request's
    cache_salt seeds the chain there too)."""
    parent = root_hash(cache_salt)
    hashes = []
    for start in range(0, len(items) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(items[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PromptHasher:
    def __init__(self, tokenizer=None, block_size: int | None = None) -> None:
        """tokenizer: the served model's Hugging Face tokenizer (with its chat template), or None.
        block_size: the engines' KV block size; None takes the engine default until a replica reports
        its own."""
        if block_size is not None and block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.tokenizer = tokenizer
        self.fixed = block_size is not None
        self.block_size = block_size or 16
        # The rendered chat tokenized from cached pieces, as the server does (earlier turns once).
        self.chat_encoder = ChatEncoder(tokenizer) if tokenizer is not None else None

    def hashes(self, path: str, body: object) -> list[int]:
        """The prompt's block hashes; [] for a request whose prompt cannot be read (the replica it goes
        to answers it, with whatever error it deserves)."""
        if not isinstance(body, dict):
            return []
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        try:
            if self.tokenizer is not None:
                return chain(self._token_ids(path, body), self.block_size, salt)
            return chain(_text(path, body), TEXT_BLOCK_CHARS, salt)
        except (ValueError, TypeError, KeyError, AttributeError):
            return []

    def _token_ids(self, path: str, body: dict) -> list[int]:
        from tokenmill.serving.prompt import render_prompt

        if path.endswith("chat/completions"):
            from tokenmill.entrypoints.openai.protocol import ChatMessage

            messages = [ChatMessage.model_validate(m).template_dict() for m in body["messages"]]
            rendered = render_prompt(
                self.tokenizer,
                messages=messages,
                add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"),
                encode=self.chat_encoder.encode,  # set whenever there is a tokenizer
            )
            return rendered.token_ids
        prompt = _first_prompt(body.get("prompt") if path.endswith("completions") else body.get("input"))
        return render_prompt(self.tokenizer, prompt).token_ids


def _first_prompt(prompt: object) -> str | list[int]:
    """A completion's prompt: a text, token ids, or a list of either (the first one routes the batch)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise ValueError("no prompt")


def _text(path: str, body: dict) -> str:
    if path.endswith("chat/completions"):
        return "".join(f"<{m.get('role')}>{_content(m.get('content'))}" for m in body["messages"])
    prompt = _first_prompt(body.get("prompt") if path.endswith("completions") else body.get("input"))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _content(content: object) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""
