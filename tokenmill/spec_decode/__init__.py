"""Speculative decoding: a proposer guesses the next few tokens of a request, the target model scores
them all in one step, and verification keeps the longest prefix the target agrees with (plus one token
of its own), so the output is what the target alone would have produced. See docs/speculative.md."""

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.replay import ReplayProposer

__all__ = ["NgramProposer", "ReplayProposer", "SpeculativeConfig"]
