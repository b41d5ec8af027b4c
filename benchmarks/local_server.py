"""`tokenmill serve` as a child process for benchmark scripts: started with the given flags, ready once
/health answers, stopped with SIGTERM on the way out."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx


@contextlib.contextmanager
def local_server(
    flags: list[str],
    port: int,
    log_path: str | None = None,
    python_flags: Sequence[str] = (),
    timeout: float = 600.0,
) -> Iterator[subprocess.Popen]:
    """Yields the running server process (at http://127.0.0.1:PORT) once it is healthy."""
    command = [
        sys.executable,
        *python_flags,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        *flags,
    ]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited during start-up (see {log_path or 'its output'})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout:.0f} s")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        yield server
    finally:
        server.terminate()
        server.wait(60)
        if log_path:
            log.close()
