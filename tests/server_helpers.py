"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time


class ServerThread:
    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info", lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def wait_until(cond, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def engine_idle(server, timeout: float = 20.0) -> bool:
    """Wait until the server's engine has no work and every KV slot is free again."""
    e = server.engine
    return wait_until(lambda: not e.has_work and e.scheduler.kv_in_use == 0, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliProcess:
    """``specfw <args>`` as a subprocess (output in ``log``); ``healthy(url)`` waits for ``/health``;
    leaving the ``with`` block sends Ctrl-C (SIGINT) and waits for the exit."""

    def __init__(self, args: list[str], log):
        import os
        import subprocess
        import sys
        from pathlib import Path

        exe = Path(sys.executable).parent / "specfw"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "specfw.cli"]
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd + args, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def healthy(self, url: str, timeout: float = 180) -> bool:
        import httpx2

        def up():
            try:
                return httpx2.get(url + "/health", timeout=2).status_code == 200
            except httpx2.HTTPError:
                return self.proc.poll() is not None

        return wait_until(up, timeout, 0.5) and self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 30) -> None:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "CliProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
