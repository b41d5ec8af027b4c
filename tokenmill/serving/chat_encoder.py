"""A rendered chat's token ids from cached pieces: a conversation's system prompt and earlier turns are
tokenized once, not again at every turn.

A Hugging Face tokenizer cuts its input at special tokens (those that match exactly, whatever surrounds
them) before it normalizes or pre-tokenizes anything, so the text between two of them tokenizes the same
wherever it stands. A chat template writes such tokens around every message, and the pieces between them
repeat from one turn of a conversation to the next: tokenizing a 2,000-token conversation takes ~4 ms on
one core, the new turn's piece a small part of it, and a long agent history tens of milliseconds, all of
it on the request's path to its first token. Tokenizers whose pieces do interact (a Metaspace
pre-tokenizer that prepends its space to the text's first piece only, a Python tokenizer with rules of
its own) fail a probe when the encoder is made, and then every text is tokenized whole; a sample of
texts is also checked against the whole-text tokenization as it goes."""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict

logger = logging.getLogger(__name__)

# Tokens kept (as 4-byte ids: 16 MiB), least recently used pieces dropped first.
DEFAULT_CACHE_TOKENS = 4 << 20
# Every so many texts, the pieces' ids are checked against tokenizing the whole text.
CHECK_EVERY = 64
# What the probe writes between special tokens: a first piece that starts the text, pieces that start
# with spaces, tabs and newlines, digits and letters outside ASCII.
_PROBE_PIECES = ("Start here", " one  two\n", "\n\nthree 42 ", "  héllo wörld!\t", "x", " 1234567 end\n")


class ChatEncoder:
    def __init__(self, tokenizer, max_cached_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        """tokenizer: a Hugging Face tokenizer. max_cached_tokens: how many token ids the cache holds."""
        if max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0, got {max_cached_tokens}")
        self.tokenizer = tokenizer
        self.max_cached_tokens = max_cached_tokens
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        self._count = 0
        self._lock = threading.Lock()
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special = {
            token.content: token_id for token_id, token in added.items()
            if token.special and not (token.lstrip or token.rstrip or token.normalized)
        }  # fmt: skip
        self._split: re.Pattern | None = None
        if self._special and max_cached_tokens > 0:
            alternatives = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
            self._split = re.compile(f"({alternatives})")
            if not self._probe():
                logger.info("chat prompts are tokenized whole: this tokenizer's pieces interact")
                self._disable()

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        """tokenizer.encode(text, add_special_tokens=False), assembled from cached pieces. Safe from
        several threads (the router hashes large bodies on worker threads); they take turns, which costs
        nothing a tokenizer holding the GIL would not."""
        with self._lock:
            return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        ids = self._pieced(text)
        self._count += 1
        if (self._count - 1) % CHECK_EVERY == 0:  # the first text, then every CHECK_EVERY-th
            whole = self._whole(text)
            if ids != whole:
                logger.warning("a chat prompt tokenized by pieces differs from the whole; tokenizing whole")
                self._disable()
                return whole
        return ids

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _pieced(self, text: str, remember: bool = True) -> list[int]:
        assert self._split is not None
        pieces = [piece for piece in self._split.split(text) if piece]
        missing = [
            piece for piece in dict.fromkeys(pieces)
            if piece not in self._special and not (remember and piece in self._pieces)
        ]  # fmt: skip
        fresh = dict(zip(missing, self._encode_pieces(missing), strict=True))
        ids: list[int] = []
        for piece in pieces:
            special = self._special.get(piece)
            if special is not None:
                ids.append(special)
                continue
            cached = fresh.get(piece)
            if cached is None:
                cached = self._pieces[piece]
                self._pieces.move_to_end(piece)
            ids.extend(cached)
        if remember:
            for piece, piece_ids in fresh.items():
                self._remember(piece, piece_ids)
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[array]:
        """The pieces no cache holds, tokenized in one batch where the tokenizer has a Rust backend (its
        threads take them in parallel: a new turn brings at least two, its question and the answer
        before it, and a conversation seen first here all of them); one by one otherwise."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if len(pieces) > 1 and backend is not None:
            return [array("i", e.ids) for e in backend.encode_batch(pieces, add_special_tokens=False)]
        return [array("i", self._whole(piece)) for piece in pieces]

    def _remember(self, piece: str, ids: array) -> None:
        if len(ids) > self.max_cached_tokens:
            return
        self._pieces[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.max_cached_tokens:
            _, dropped = self._pieces.popitem(last=False)
            self._cached_tokens -= len(dropped)

    def _probe(self) -> bool:
        """Whether texts made of probe pieces and this tokenizer's special tokens tokenize alike whole and
        by pieces (nothing is cached by it)."""
        specials = sorted(self._special)[:4]
        texts = []
        for special in specials:
            text = "".join(piece + specials[i % len(specials)] for i, piece in enumerate(_PROBE_PIECES))
            texts += [text, special + text, text + special + " tail"]
        try:
            if any(self._pieced(text, remember=False) != self._whole(text) for text in texts):
                return False
        except Exception:  # a tokenizer that cannot take the probe's text keeps its own way
            return False
        return True

    def _disable(self) -> None:
        self._split = None
        self._pieces.clear()
        self._cached_tokens = 0
