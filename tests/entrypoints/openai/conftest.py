"""Fixtures that start the real server (`python -m tokenmill.entrypoints.cli serve`) on a free localhost port,
as a user would, and reach it with the official openai client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
MODEL_NAMES = ("default", "smollm2")
# Small enough to load fast, large enough for 64 concurrent short requests.
MAIN_SERVER_ARGS = ["--model", "default", "--served-model-name", *MODEL_NAMES]
MAIN_SERVER_ARGS += ["--max-model-len", "1024", "--num-kv-blocks", "512"]
# fp32 on every CPU: "auto" is bf16 where the CPU has AMX or AVX512-BF16, and greedy text in bf16 depends
# on how requests happen to be batched, which tests comparing two servers' answers must not.
MAIN_SERVER_ARGS += ["--dtype", "float32"]
# Steps of 256 tokens (the CPU default is 512), so a prompt that fits max_model_len still takes several
# chunks: the concurrency tests send a request while one is being prefilled.
MAIN_SERVER_ARGS += ["--max-num-batched-tokens", "256"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `tokenmill serve` (or `tokenmill router`) subprocess, its log in a file (a pipe nobody reads
    would fill and block it)."""

    def __init__(
        self, args: list[str], log_path: Path, api_key: str | None = None, subcommand: str = "serve"
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "tokenmill.entrypoints.cli", subcommand, "--port", str(self.port)]
        command += (["--no-access-log"] if subcommand == "serve" else []) + args
        command += ["--api-key", api_key] if api_key else []
        # One torch thread whatever the machine, the same as the offline LLM the greedy test compares with.
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_text()[-3000:]}")

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        key = api_key or self.api_key or "none"
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120
        )

    def post(self, path: str, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.post(f"{self.url}{path}", headers={**auth, **(headers or {})}, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}, plus {'name': value} for series with one label set."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                values[series] = float(value)
                values.setdefault(series.split("{")[0], float(value))
        return values

    def core_pid(self) -> int:
        """The engine-core process: the child started through multiprocessing's spawn_main."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and b"spawn_main" in cmdline:
                return int(stat.parent.name)
        raise LookupError("no engine-core child process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def wait_for(condition, timeout: float = 15.0, interval: float = 0.1):
    """Poll until condition() is truthy; returns its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = condition()
    return value


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server on the embedded SmolLM2 model."""
    process = ServerProcess(MAIN_SERVER_ARGS, tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


# The chat template the vLLM-flags server is given inline (--chat-template).
VLLM_FLAGS_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="session")
def vllm_flags_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Random weights started with the flags people pass to `vllm serve`, for test_vllm_serve_flags.py and
    test_generation_config.py (one boot for both; only behaviour counts): the model as a positional
    argument, an inline chat template, a response role, request logging, a root path, knobs that hold
    whatever they say, and a generation config (temperature 0, top_p 0.9, max_new_tokens 3) whose
    max_new_tokens an override sets to 4."""
    directory = tmp_path_factory.mktemp("vllm_flags")
    config = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True, "eos_token_id": 2}
    (directory / "generation_config.json").write_text(json.dumps(config))
    args = ["default", "--load-format", "dummy", "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--chat-template", VLLM_FLAGS_TEMPLATE, "--response-role", "bot", "--enable-log-requests"]
    args += ["--root-path", "/api", "--trust-remote-code", "--enable-chunked-prefill"]
    args += ["--uvicorn-log-level", "warning"]
    args += ["--generation-config", str(directory), "--override-generation-config", '{"max_new_tokens": 4}']
    process = ServerProcess(args, directory / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()
