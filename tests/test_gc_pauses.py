"""GCPauses times this process's collections through gc.callbacks, keeps the long ones with their wall
time, logs the ones over its threshold, and stops when uninstalled."""

from __future__ import annotations

import gc
import logging
import time

from tokenmill.gc_pauses import GCPauses


def _cycles(count: int) -> None:
    for _ in range(count):
        a: list = []
        a.append(a)  # garbage only a collection frees


def test_collections_are_counted_timed_kept_and_logged(caplog) -> None:
    pauses = GCPauses("test process", log_over_s=0.0, keep_over_s=0.0).install()
    try:
        before = time.time()
        with caplog.at_level(logging.WARNING, logger="tokenmill.gc"):
            _cycles(1000)
            gc.collect()
        after = time.time()
    finally:
        pauses.uninstall()
    summary = pauses.summary()
    assert summary["process"] == "test process" and summary["collections"][2] >= 1
    assert summary["max_ms"] > 0 and summary["total_ms"] >= summary["max_ms"]
    started, generation, ms = summary["kept"][-1]
    assert before - 1 <= started <= after and generation in (0, 1, 2) and ms > 0
    assert "test process paused" in caplog.text and "generation-2" in caplog.text
    counted = sum(summary["collections"])
    gc.collect()
    assert sum(pauses.summary()["collections"]) == counted  # uninstalled: no longer counting


def test_only_pauses_over_the_thresholds_are_kept_or_logged(caplog) -> None:
    pauses = GCPauses("quiet", log_over_s=10.0, keep_over_s=10.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.gc"):
            gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.summary()["kept"] == [] and "quiet" not in caplog.text
    assert pauses.summary()["pauses_over_ms"] == {}  # 10 ms and more are not tracked at a 10 s threshold
