"""Incremental detokenization with stop strings. Text is emitted only once it is valid UTF-8 (the
tokenizers library's DecodeStream buffers partial byte sequences), and while stop strings are active the
last few characters are withheld so a stop string is never half streamed."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context
# (SentencePiece-style tokenizers decide leading spaces from the previous token).
_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=params.skip_special_tokens
        )
        self._params = params
        self.output_text = ""
        self.num_emitted = 0  # characters of output_text already handed out
        # With stop strings: where each token's text starts in output_text, so the tokens of a stop
        # string cut from the text can be told apart (their logprobs are not reported).
        self.token_starts: list[int] | None = [] if params.stop else None

    def update(
        self, new_token_ids: list[int], check_stop: bool = True, last_in_text: bool = True
    ) -> str | None:
        """Add tokens; returns the stop string that matched (text is then cut before it), else None.
        check_stop is False while the request is still under its min_tokens. last_in_text False: the
        last token (an EOS or stop token that ended the request) adds no text, as in vLLM unless
        include_stop_str_in_output."""
        for index, token_id in enumerate(new_token_ids):
            start = len(self.output_text)
            if self.token_starts is not None:
                self.token_starts.append(start)
            if not last_in_text and index == len(new_token_ids) - 1:
                break
            chunk = self._stream.step(self._backend, token_id)
            if chunk:
                self.output_text += chunk
                stop = self._check_stop_strings(start) if check_stop else None
                if stop is not None:
                    return stop
        return None

    def _check_stop_strings(self, new_start: int) -> str | None:
        for stop in self._params.stop:
            # Only a match that ends inside the new text is new; search from where it could begin.
            search_from = max(0, new_start - len(stop) + 1)
            index = self.output_text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self._params.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted, minus the withheld tail unless the request has finished."""
        end = len(self.output_text)
        if not finished:
            end = max(self.num_emitted, end - self._params.stop_buffer_length)
        delta = self.output_text[self.num_emitted : end]
        self.num_emitted = end
        return delta
