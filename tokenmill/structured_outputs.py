"""Structured outputs with llguidance: a request's constraint (sampling_params.StructuredOutputsParams)
becomes an llguidance grammar, compiled once per distinct constraint and cached; each request holds a
matcher that advances with its tokens. Before a step samples, the scheduler fills one bitmask row (a bit
per vocabulary entry, 32 to an int32) for each constrained request that samples in it, and the worker
sets the logits of the tokens the grammar forbids to -inf before any sampling (worker/sampler.py).

The llguidance tokenizer is built from the model's Hugging Face tokenizer on first use (about a second;
the server builds it at start-up).

Masks are filled in parallel, by llguidance's thread pool, but copies of one compiled matcher share its
lexer and take turns at it: 64 requests under one schema filled one at a time (8.9 ms a step on the
H200's host, against ~2 ms for the forward pass of the 0.6B model). So a constraint in use by many requests
is compiled again, up to once per mask thread (a "family" of copies each), and a step's matchers go to
the pool grouped by family: the threads then work on different lexers.

The pool's workers take whichever matchers they steal, anew each step. Threads that each kept the same
families every step (their lexers in one core's caches) filled 1.7-1.9x slower on the H200's host, where
the stealing's balance counts for more (docs/performance.md, twenty-ninth session): not kept."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenmill.grammar_tokenizers import GrammarTokenizers
from tokenmill.grammars import constraint_schemas, grammar_text
from tokenmill.json_schemas import refused_keywords
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.thinking import CLOSED, END, START, AfterThinking, finish_gated, starts_inside

# Compiled constraints kept, by their text, and compiled matchers ("families") kept over all of them.
_CACHE_SIZE = 512
_MAX_COMPILED = 1024
# llguidance's own default: 80% of the CPUs this process may run on, up to 32.
MASK_THREADS = max(1, min(32, int(0.8 * len(os.sched_getaffinity(0)))))
MAX_FAMILIES = 64


def _key(params: StructuredOutputsParams) -> str:
    value = True if params.kind == "json_object" else getattr(params, params.kind)
    # Not sorted: a schema's property order is the order its output writes them in.
    text = value if isinstance(value, str) else json.dumps(value)
    return "\0".join((params.kind, params.whitespace_pattern or "", text))


class _Families:
    """The compiled matchers (never advanced) of one constraint, and how many live requests hold a copy
    of each."""

    __slots__ = ("roots", "ids", "live", "first_mask")

    def __init__(self, root, family_id: int, first_mask: bytes) -> None:
        self.roots, self.ids, self.live = [root], [family_id], [0]
        self.first_mask = first_mask  # the tokens the constraint allows first (llguidance's bitmask)


class StructuredOutputs:
    """Grammar compilation and masks for one model's tokenizer."""

    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        mask_threads: int = MASK_THREADS,
        max_families: int = MAX_FAMILIES,
        slices: list[str] | None = None,
    ) -> None:
        """load_tokenizer: returns the model's Hugging Face fast tokenizer, called on first use.
        mask_threads: llguidance threads filling a step's masks. max_families: the most compilations
        ("families") of one constraint that requests are dealt over; copies of one compiled matcher share
        its lexer and its caches, so the threads' work on requests of one family contends. slices: the
        regexes of llguidance's slicer (token sets it precomputes for the masks; [] none), None its
        defaults."""
        for name, value in (("mask_threads", mask_threads), ("max_families", max_families)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.mask_threads = mask_threads
        self.max_families = max_families
        self.slices = slices
        self._tokenizers: GrammarTokenizers | None = None
        self._thinking_tags: tuple[int, ...] | None = None
        self._executor = None
        self._compiled: OrderedDict[str, _Families] = OrderedDict()
        self.num_compiled = 0  # families over every constraint in the cache
        self._family_of: dict[int, tuple[_Families, int]] = {}  # family id -> (its constraint's, index)
        self._family_ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def tokenizers(self) -> GrammarTokenizers:
        """llguidance's views of the tokenizer (and the mask threads), built on first use."""
        with self._lock:
            if self._tokenizers is None:
                import llguidance

                self._tokenizers = GrammarTokenizers(self.load_tokenizer(), self.vocab_size, self.slices)
                self._executor = llguidance.LLExecutor(self.mask_threads)
            return self._tokenizers

    @property
    def ll_tokenizer(self):
        return self.tokenizers.fast

    def _compile(self, params: StructuredOutputsParams):
        import llguidance

        text = grammar_text(params)  # its ValueError names the field already
        if params.whitespace_pattern is not None:
            self._check_whitespace(params.whitespace_pattern)
        tokenizer = self.tokenizers.for_grammar(text)
        try:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"structured_outputs {params.kind}: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs {params.kind}: {matcher.get_error()}")
        # Compiled leniently, a schema keyword llguidance lacks is a warning, and the output could break it.
        refused = refused_keywords(matcher.get_grammar_warnings(), constraint_schemas(params))
        if refused:
            raise ValueError(f"structured_outputs {params.kind}: {refused}")
        return matcher

    def first_tokens(self, params: StructuredOutputsParams) -> np.ndarray | None:
        """Whether a request's first token may be each vocabulary entry (bool), as its matcher() masks it:
        the constraint's first tokens, and `<think>` where the model may open the thinking (AfterThinking);
        None where the output starts inside the thinking (anything may come first)."""
        words = np.frombuffer(self.compiled(params).first_mask, dtype=np.uint8)
        first = np.unpackbits(words, bitorder="little")[: self.vocab_size].astype(bool)
        tags = self._thinking_gate(params)
        if tags is not None:
            if starts_inside(params.reasoning, params.prompt_thinking):
                return None
            first[tags[0]] = True
        return first

    @staticmethod
    def _first_mask(matcher, params: StructuredOutputsParams) -> bytes:
        r"""The compiled matcher's first mask, from a copy; a ValueError for a constraint no text meets (a
        regex `[^\s\S]`, a Lark intersection of disjoint sets): llguidance compiles it, and its first mask,
        which allows nothing, sets the error."""
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(f"structured_outputs {params.kind}: no text satisfies the constraint.")
        # The copies share the lexer, whose first mask may build it past llguidance's limits (a regex
        # a{300000}): then the first copy's mask is whole, and every later copy's (each request's) fails.
        second = matcher.deep_copy()
        second.compute_bitmask()
        if second.is_error():
            reason = second.get_error().split("\n", 1)[0]
            raise ValueError(
                f"structured_outputs {params.kind}: too large for the grammar engine ({reason})."
            )
        return mask

    def _check_whitespace(self, pattern: str) -> None:
        """A ValueError for a whitespace_pattern that matches anything but JSON's whitespace (space, tab,
        newline, carriage return): put between the JSON's tokens, it would break the JSON. llguidance
        decides it: the pattern's language less JSON's whitespace leaves a matcher nothing to take."""
        import llguidance

        lexeme = llguidance.regex_to_lark(pattern)
        grammar = f"start: OUTSIDE\nOUTSIDE: /(?:{lexeme})/ & ~/[ \\t\\n\\r]*/\n"
        try:
            outside = llguidance.LLMatcher(
                self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
            )
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"structured_outputs whitespace_pattern: {exc}") from None
        outside.compute_bitmask()  # an empty language shows as an error once a mask is asked for
        if not outside.is_error():
            raise ValueError(
                f"structured_outputs whitespace_pattern {pattern!r} matches more than JSON's whitespace "
                "(space, tab, newline, carriage return; \\s is Unicode's), which would break the JSON: use "
                "a pattern over [ \\t\\n\\r]"
            )

    def compiled(self, params: StructuredOutputsParams) -> _Families:
        """The constraint compiled against the tokenizer (a ValueError naming the field when llguidance
        refuses it), from the cache when seen."""
        key = _key(params)
        families = self._compiled.get(key)
        if families is not None:
            self._compiled.move_to_end(key)
            return families
        root = self._compile(params)
        families = _Families(root, next(self._family_ids), self._first_mask(root, params))
        self._compiled[key] = families
        self._family_of[families.ids[0]] = (families, 0)
        self.num_compiled += 1
        self._evict()
        return families

    def _evict(self) -> None:
        """Least recently used constraints out, past _CACHE_SIZE constraints or _MAX_COMPILED families
        (never the one just used; live requests keep their own copies)."""
        while len(self._compiled) > 1 and (
            len(self._compiled) > _CACHE_SIZE or self.num_compiled > _MAX_COMPILED
        ):
            _, families = self._compiled.popitem(last=False)
            self.num_compiled -= len(families.roots)
            for family_id in families.ids:
                del self._family_of[family_id]

    def matcher(self, params: StructuredOutputsParams) -> tuple[Any, int]:
        """A fresh matcher for one request (each sequence of n > 1 gets its own) and its family: a copy
        of the constraint's compiled matcher with the fewest live requests, a new one compiled when every
        one has some (up to max_families), so a constraint costs as many compilations as requests use it
        at once. release() the family when the request ends."""
        families = self.compiled(params)
        turn = min(range(len(families.roots)), key=families.live.__getitem__)
        if families.live[turn] and len(families.roots) < self.max_families:
            turn = len(families.roots)
            families.roots.append(self._compile(params))
            families.ids.append(next(self._family_ids))
            families.live.append(0)
            self._family_of[families.ids[turn]] = (families, turn)
            self.num_compiled += 1
            self._evict()
        families.live[turn] += 1
        matcher = families.roots[turn].deep_copy()
        tags = self._thinking_gate(params)
        if tags is not None:
            inside = starts_inside(params.reasoning, params.prompt_thinking)
            matcher = AfterThinking(matcher, *tags, inside=inside)
        return matcher, families.ids[turn]

    def _thinking_gate(self, params: StructuredOutputsParams) -> tuple[int, int] | None:
        """`<think>` and `</think>`'s ids where a request's grammar waits for the thinking (AfterThinking):
        under a reasoning parser, with tags of their own; a prompt that closed the thinking leaves none."""
        if params.reasoning is None or params.prompt_thinking == CLOSED:
            return None
        return self.thinking_tags()

    def thinking_tags(self) -> tuple[int, int] | None:
        """The ids of `<think>` and `</think>` where the tokenizer has each as one token, else None (a
        model that does not think: its constraint applies from the first token)."""
        if self._thinking_tags is None:
            tokenizer = self.load_tokenizer()
            ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
            self._thinking_tags = (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else ()
        return self._thinking_tags or None

    def release(self, family_id: int) -> None:
        """A request holding a copy from this family ended (a family evicted since: nothing to do)."""
        entry = self._family_of.get(family_id)
        if entry is not None:
            families, index = entry
            families.live[index] -= 1

    def fill_bitmask(self, matchers: list, families: list[int] | None = None) -> np.ndarray:
        """One row of allowed tokens per matcher, [len(matchers), words] int32, filled in parallel by
        llguidance's threads, the matchers grouped by family (`families`, as matcher() returned them).
        A None matcher (its request finished while the step ran) gets a row that allows everything, a
        stopped one (complete, or in error) llguidance's row that allows EOS only: nothing either samples
        is kept."""
        return self.bitmask_fill(matchers, families)()

    def bitmask_fill(
        self,
        matchers: list,
        families: list[int] | None = None,
        out: np.ndarray | None = None,
        consume: list[tuple[Any, int]] | None = None,
        claimed: tuple[Callable[[], list[int]], list[tuple[Any, int]]] | None = None,
    ) -> Callable[..., np.ndarray]:
        """fill_bitmask in two halves: the Python half now (the array, the rows that allow everything, the
        work grouped by family), and a call for a helper thread that hands `consume`'s (matcher, token)
        pairs to their matchers, then `claimed`'s tokens (a call returning a step's tokens, one a row,
        once they are on the host, and (matcher, row) pairs), calls its argument, then fills the masks,
        each in llguidance without the GIL, and returns the array. out: the array to fill
        ([len(matchers), words] int32, C-contiguous; every row is written), else a new one."""
        mask = np.zeros((len(matchers), self.words), dtype=np.int32) if out is None else out
        assert mask.shape == (len(matchers), self.words) and mask.flags.c_contiguous
        order = (
            range(len(matchers))
            if families is None
            else sorted(range(len(matchers)), key=families.__getitem__)
        )
        work = []
        gated = []  # (AfterThinking, row): filled once their tokens tell whether the model still thinks
        for row in order:
            matcher = matchers[row]
            if matcher is None:
                mask[row] = -1
            elif isinstance(matcher, AfterThinking):
                gated.append((matcher, row))
            else:
                work.append((matcher, row))
        executor = self._executor
        consume_gated: list[tuple[Any, int]] = []
        claimed_gated: list[tuple[Any, int]] = []
        if gated:  # their tokens go through the gates, in order, one at a time
            consume_gated = [(m, t) for m, t in consume or [] if isinstance(m, AfterThinking)]
            consume = [(m, t) for m, t in consume or [] if not isinstance(m, AfterThinking)]
            if claimed:
                claimed_gated = [(m, r) for m, r in claimed[1] if isinstance(m, AfterThinking)]
                claimed = (claimed[0], [(m, r) for m, r in claimed[1] if not isinstance(m, AfterThinking)])
        # llguidance's parallel consume refuses a matcher named twice; a matcher holds at most one token
        # between fills, but several would go one at a time rather than fail the step.
        serial = bool(consume) and len({id(matcher) for matcher, _ in consume}) < len(consume)

        def fill(consumed: Callable[[], None] = lambda: None) -> np.ndarray:
            # Between the calls the helper takes the GIL back; whether a matcher is stopped is not asked
            # (that would be Python between them too): llguidance's mask for one allows EOS. A token the
            # mask did not allow leaves its matcher in error, which is stopped.
            if serial:
                for matcher, token in consume:
                    matcher.consume_token(token)
            elif consume:
                executor.consume_token_par(consume)
            for gate, token in consume_gated:
                gate.consume_token(token)
            if claimed:
                tokens_of, rows = claimed
                tokens = tokens_of()
                if rows:
                    executor.consume_token_par([(matcher, tokens[row]) for matcher, row in rows])
                for gate, row in claimed_gated:
                    gate.consume_token(tokens[row])
            consumed()
            # AfterThinking rows, now that their tokens are in: the grammar's once the model answers.
            rows = work + [(gate.matcher, row) for gate, row in gated if not gate.thinking] if gated else work
            if rows:  # matchers exist only once ll_tokenizer (and the executor) were built
                executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, self.words * 4, len(matchers))
            if gated:
                finish_gated(gated, mask)
            return mask

        return fill


def apply_bitmask(logits, rows, bitmask) -> None:
    """logits [R, V] (torch), in place: at each of `rows`, -inf wherever its bitmask row has a 0 bit.
    rows and bitmask may already be on logits' device (the model runner stages them with the step's other
    host arrays, through pinned memory); arrays and lists are copied there."""
    import torch

    if not len(rows):
        return
    device = logits.device
    mask = torch.as_tensor(bitmask, device=device)
    index = torch.as_tensor(rows, dtype=torch.int64, device=device)
    if device.type == "cuda":  # one launch instead of the eight below
        from tokenmill.kernels.bitmask import apply_bitmask as apply_bitmask_kernel

        apply_bitmask_kernel(logits, index, mask.contiguous())
        return
    # The forbidden tokens' bits, unpacked by numpy (a byte each, little-endian within a word): for 64 x
    # 49,152 on a two-core CPU, ~11 ms with the fill against ~16 ms for shifting in torch.
    words = np.ascontiguousarray(mask.numpy(), dtype=np.int32)
    forbidden = np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    forbidden_t = torch.from_numpy(forbidden.view(np.bool_))
    if forbidden_t.shape[1] < logits.shape[1]:  # tokens past the mask's last word are forbidden
        forbidden_t = torch.nn.functional.pad(
            forbidden_t, (0, logits.shape[1] - forbidden_t.shape[1]), value=True
        )
    selected = logits.index_select(0, index)
    logits.index_copy_(0, index, selected.masked_fill_(forbidden_t, float("-inf")))
