"""Is a started server up: the one ``/health`` poll of ``ternary-rs serve``, the benches and the tests
(vLLM's OpenAI server and llama.cpp's ``llama-server`` both answer ``GET /health`` with 200 when ready),
and a free local port to start one on."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerNotHealthy(RuntimeError):
    """The server exited before it answered (``returncode`` set) or did not answer in time (None)."""

    def __init__(self, message: str, returncode: int | None):
        super().__init__(message)
        self.returncode = returncode


def is_healthy(base: str, timeout: float = 5) -> bool:
    """One probe: does ``base/health`` answer 200?"""
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out: not up (yet)
        return False


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, poll_s: float = 1.0) -> float:
    """Poll ``base/health`` every ``poll_s`` until it answers 200; the seconds that took. Raises
    :class:`ServerNotHealthy` when ``proc`` exits first or ``timeout_s`` passes (the caller adds its log)."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise ServerNotHealthy(f"server exited with code {proc.returncode}", proc.returncode)
        if is_healthy(base):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ServerNotHealthy(f"no {base}/health answer in {timeout_s} s", None)
        time.sleep(poll_s)
