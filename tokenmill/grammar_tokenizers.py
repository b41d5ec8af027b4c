"""llguidance's views of the model's tokenizer: the one built from the tokenizer's JSON (Rust throughout,
what every constraint uses), and one whose tokenization reads a special token's text as plain text, for
the constraints that spell such a text.

llguidance writes a constraint's fixed text (a key, a `const`, a choice) as the tokens the tokenizer makes
of it, and the JSON's tokenizer makes `<|im_end|>` of the text "<|im_end|>", a special token, which the
grammar then refuses (llguidance keeps special tokens apart from text): the matcher fails, and the answer
ended there. The plain view tokenizes through Python (`encode_special_tokens`), so its llguidance threads
take the GIL for each fixed text (~0.7 calls a mask on the bounded schema of docs/performance.md): only
the constraints that need it get it."""

from __future__ import annotations

import copy
import json
import threading


def tokenizer_json(hf_tokenizer) -> str:
    """The fast tokenizer's JSON as llguidance reads it. llguidance maps tokens to bytes through a byte
    level decoder only when the decoder is exactly ByteLevel; transformers' GGUF conversion (the embedded
    model's) writes a Sequence ending in ByteLevel over a ByteLevel pre-tokenizer, which it would read
    as text ("Ġyes" for " yes"). Such a tokenizer gets the plain ByteLevel decoder its tokens use."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    pre = data.get("pre_tokenizer") or {}
    decoder = data.get("decoder") or {}
    if (
        pre.get("type") == "ByteLevel"
        and decoder.get("type") == "Sequence"
        and any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    ):
        data["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        }
    return json.dumps(data)


class _PlainText:
    """What llguidance's TokenizerWrapper reads: each token's bytes, the special ones by id, and a call
    that tokenizes text with special tokens' texts as text."""

    def __init__(self, hf_tokenizer, fast, vocab_size: int) -> None:
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.tokens = [fast.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if fast.is_special_token(i)]
        self._backend = copy.copy(hf_tokenizer.backend_tokenizer)
        self._backend.no_padding()
        self._backend.no_truncation()
        self._backend.encode_special_tokens = True

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):  # llguidance hands whole UTF-8 characters, the rest it tokenizes itself
            text = text.decode("utf-8", errors="replace")
        return self._backend.encode(text, add_special_tokens=False).ids


class GrammarTokenizers:
    """The fast view, built now (~0.3 s), the plain one on first need, and which one a grammar takes."""

    def __init__(self, hf_tokenizer, vocab_size: int, slices: list[str] | None) -> None:
        import llguidance

        eos = hf_tokenizer.eos_token_id
        self.fast = llguidance.LLTokenizer(
            tokenizer_json(hf_tokenizer), n_vocab=vocab_size, eos_token=eos, slices=slices
        )
        self._hf_tokenizer, self._vocab_size, self._slices = hf_tokenizer, vocab_size, slices
        texts = (self.fast.decode_bytes([i]) for i in range(vocab_size) if self.fast.is_special_token(i))
        self.special_texts = sorted({t.decode("utf-8", errors="replace") for t in texts} - {""})
        self._plain = None
        self._lock = threading.Lock()

    def for_grammar(self, text: str):
        """The plain view where the grammar's text holds a special token's text (backslashes dropped: a
        regex escapes `|`; a false match costs only speed), else the fast one."""
        unescaped = text.replace("\\", "")
        if any(special in unescaped for special in self.special_texts):
            return self.plain
        return self.fast

    @property
    def plain(self):
        with self._lock:
            if self._plain is None:
                import llguidance
                from llguidance._tokenizer import TokenizerWrapper

                wrapper = TokenizerWrapper(_PlainText(self._hf_tokenizer, self.fast, self._vocab_size))
                eos = self._hf_tokenizer.eos_token_id
                self._plain = llguidance.LLTokenizer(
                    wrapper, n_vocab=self._vocab_size, eos_token=eos, slices=self._slices
                )
            return self._plain
