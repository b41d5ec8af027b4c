"""Routing policies: given each healthy replica's load and how many leading blocks of the prompt it is
believed to hold (index.PrefixIndex), pick one. Pure and clock-free, so `router simulate` runs the same
code the proxy does."""

from __future__ import annotations

import random
from collections.abc import Mapping

POLICIES = ("cache_aware", "least_load", "round_robin", "random")


class Policy:
    name = ""

    def choose(self, matched: Mapping[str, int], loads: Mapping[str, float]) -> str:
        """matched and loads have the same keys: the healthy replicas, in a stable order."""
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, matched: Mapping[str, int], loads: Mapping[str, float]) -> str:
        replicas = list(loads)
        self._turn += 1
        return replicas[(self._turn - 1) % len(replicas)]


class Random(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, matched: Mapping[str, int], loads: Mapping[str, float]) -> str:
        return self._rng.choice(list(loads))


class LeastLoad(Policy):
    """The replica with the fewest requests in hand; ties taken in turn, so an idle fleet fills evenly."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, matched: Mapping[str, int], loads: Mapping[str, float]) -> str:
        least = min(loads.values())
        tied = [replica for replica, load in loads.items() if load == least]
        self._turn += 1
        return tied[(self._turn - 1) % len(tied)]


class CacheAware(Policy):
    """The replica holding the longest prefix of the prompt, unless its load exceeds the least loaded
    replica's by more than `balance_threshold` requests; otherwise (and for a prompt no replica holds)
    the least loaded, preferring among equals the one holding more of the prompt. New prefixes thus
    spread by load, and each then stays where its cache is for as long as that replica keeps up."""

    name = "cache_aware"

    def __init__(self, balance_threshold: float = 16) -> None:
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        self.balance_threshold = balance_threshold
        self._least = LeastLoad()

    def choose(self, matched: Mapping[str, int], loads: Mapping[str, float]) -> str:
        least = min(loads.values())
        best = max(loads, key=lambda replica: (matched[replica], -loads[replica]))
        if matched[best] > 0 and loads[best] - least <= self.balance_threshold:
            return best
        idle = [replica for replica, load in loads.items() if load == least]
        most = max(matched[replica] for replica in idle)
        return self._least.choose(matched, {r: least for r in idle if matched[r] == most})


def make_policy(name: str, balance_threshold: float = 16, seed: int | None = None) -> Policy:
    if name == "cache_aware":
        return CacheAware(balance_threshold)
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(seed)
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
