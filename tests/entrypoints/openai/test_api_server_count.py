"""`tokenmill serve --api-server-count 2`: one engine core behind two API processes. The same greedy text as
one process, connections spread over both, one /metrics for the whole server, SIGTERM drains all of it,
and the death of the core or of one API process takes the server down with exit 1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import MAIN_SERVER_ARGS, REPO, ServerProcess, wait_for

PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(24)]


def children(pid: int) -> list[int]:
    """The processes the launcher spawned (not multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


def listening_pids(server: ServerProcess) -> list[int]:
    """The launcher's children that listen on the server's port: the API processes."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == server.port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    pids = []
    for pid in children(server.proc.pid):
        with_socket = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                with_socket.add(os.readlink(fd))
            except OSError:
                continue
        if any(f"socket:[{inode}]" in with_socket for inode in inodes):
            pids.append(pid)
    return sorted(pids)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def greedy_texts(server: ServerProcess) -> list[str]:
    async def all_at_once() -> list[str]:
        client = server.async_client()

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model="default", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        return await asyncio.gather(*map(one, PROMPTS))

    return asyncio.run(all_at_once())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    process = ServerProcess(
        [*MAIN_SERVER_ARGS, "--api-server-count", "2"], tmp_path_factory.mktemp("asc") / "server.log"
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_same_text_as_one_process_spread_over_both_and_counted_once(pair, server):
    api_pids = wait_for(lambda: len(pids := listening_pids(pair)) == 2 and pids)
    assert len(api_pids) == 2, api_pids
    before = {pid: cpu_ticks(pid) for pid in api_pids}
    texts = greedy_texts(pair)
    # The kernel hashed 24 connections over the two sockets: both processes did work.
    assert all(cpu_ticks(pid) > before[pid] for pid in api_pids), (before, api_pids)
    assert texts == greedy_texts(server)  # the one-process server of the session
    metrics = wait_for(lambda: (m := pair.metrics()) and m["tokenmill:num_requests_running"] == 0 and m)
    success = 'tokenmill:request_success_total{engine="0",finished_reason="%s",model_name="default"}'
    assert metrics[success % "length"] + metrics[success % "stop"] == len(PROMPTS)
    # Recorded by API process 0 alone from the core's stats, so not doubled.
    assert metrics["tokenmill:request_queue_time_seconds_count"] == len(PROMPTS)
    assert metrics["tokenmill:time_to_first_token_seconds_count"] == len(PROMPTS)


def test_sigterm_stops_every_process_and_exits_0(pair):
    pids = children(pair.proc.pid)
    assert len(pids) == 3  # the core and two API processes
    start = time.monotonic()
    pair.proc.send_signal(signal.SIGTERM)
    assert pair.proc.wait(30) == 0, pair.log_text()[-3000:]
    assert time.monotonic() - start < 5
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


DUMMY = ["--model", "default", "--load-format", "dummy", "--max-model-len", "256", "--num-kv-blocks", "64"]


@pytest.mark.parametrize("victim", ["core", pytest.param("api", marks=pytest.mark.slow)])
def test_a_dead_process_takes_the_server_down_with_exit_1(victim, tmp_path):
    server = ServerProcess([*DUMMY, "--api-server-count", "2"], tmp_path / "server.log").wait_ready()
    try:
        # /health answers once one API process listens; the other follows a moment later.
        api_pids = wait_for(lambda: len(pids := listening_pids(server)) == 2 and pids)
        (core_pid,) = set(children(server.proc.pid)) - set(api_pids)
        os.kill(core_pid if victim == "core" else api_pids[0], signal.SIGKILL)
        if victim == "core":
            # The API processes fail fast and say why on /health until they go.
            assert wait_for(lambda: _health_code(server) == "engine_dead", timeout=5, interval=0.05)
        assert server.proc.wait(30) == 1, server.log_text()[-3000:]
        assert not [pid for pid in [core_pid, *api_pids] if Path(f"/proc/{pid}").exists()]
    finally:
        server.stop()


def _health_code(server: ServerProcess) -> str | None:
    try:
        return httpx.get(f"{server.url}/health", timeout=1).json().get("error", {}).get("code")
    except (httpx.HTTPError, ValueError):
        return None


def test_api_server_count_must_be_positive():
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--api-server-count", "0"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and "--api-server-count" in result.stderr and "at least 1" in result.stderr
