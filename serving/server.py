"""Launch and supervise a local vLLM server (the ``cpu`` profile): start it in its own process
group, wait until it answers, stop it cleanly (SIGTERM to the whole group, SIGKILL after a grace
period) when the caller leaves, is interrupted or is terminated."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from ckptbridge.errors import CkptBridgeError, ConfigError, InputNotFoundError
from serving.profiles import SERVE_PYTHON, ServeCommand


class ServerError(CkptBridgeError):
    exit_code = 9


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise ConfigError(f"port {port} on {host} is in use; stop what listens there or choose another --port") from None


def get_json(url: str, timeout: float = 5.0):
    import httpx

    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


class LocalServer:
    """``with LocalServer(cmd, log_path) as server: ...``: the server is up inside the block."""

    def __init__(self, command: ServeCommand, log_path: str | None = None, startup_timeout: float = 600.0,
                 outlive: bool = False):
        self.command = command
        self.log_path = log_path
        # outlive: vLLM writes to the log file itself (no pipe through this process), so that it can
        # go on serving, and logging, after this process is killed (a restarted watch adopts it)
        self.outlive = outlive and log_path is not None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._pump: threading.Thread | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=300)

    @property
    def url(self) -> str:
        return self.command.url

    def start(self) -> None:
        if not os.path.exists(SERVE_PYTHON):
            raise InputNotFoundError(f"{SERVE_PYTHON}: the serving environment is missing; run scripts/setup.sh")
        host, port = self.command.url.rsplit("//", 1)[1].rsplit(":", 1)
        check_port(host, int(port))
        if self.log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            self._log = open(self.log_path, "ab")
        env = {**os.environ, **self.command.env}
        self._log_start = self._log.tell() if self._log else 0
        self.proc = subprocess.Popen(self.command.argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=self._log if self.outlive else subprocess.PIPE, stderr=subprocess.STDOUT)
        if not self.outlive:
            self._pump = threading.Thread(target=self._copy_output, args=(self.proc.stdout,), daemon=True)
            self._pump.start()

    def _copy_output(self, stream) -> None:
        """vLLM's output goes to the log file (or this process's stderr) as it comes; the last lines
        are kept for the reason of a failure."""
        sink = self._log or sys.stderr.buffer
        for raw in iter(stream.readline, b""):
            self.last_lines.append(raw.decode("utf-8", "replace"))
            with contextlib.suppress(ValueError, OSError):
                sink.write(raw)
                sink.flush()
        stream.close()

    def failure_reason(self) -> str:
        """vLLM's own last error line, and where the whole output is."""
        from serving.vllm_facts import startup_reason

        if self._pump is not None:
            self._pump.join(timeout=10)
        lines = list(self.last_lines)
        if self.outlive:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = [raw.decode("utf-8", "replace") for raw in f.read().splitlines(keepends=True)[-300:]]
        reason = startup_reason(lines)
        where = f"full log: {self.log_path}" if self.log_path else "its output is above"
        return f": {reason} ({where})" if reason else f" ({where})"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.proc.returncode} while starting{self.failure_reason()}")
            try:
                models = get_json(f"{self.url}/v1/models", timeout=2.0)
                if any(m.get("id") == self.command.served_name for m in models.get("data", [])):
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"vLLM did not answer at {self.url} within {self.startup_timeout:.0f} s{self.failure_reason()}")

    def stop(self, grace: float = 30.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            # whatever the group left behind (engine workers) goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._pump is not None:
            self._pump.join(timeout=10)
        if self._log:
            self._log.close()
            self._log = None
        return proc.returncode if proc is not None else None

    def __enter__(self) -> LocalServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(server: LocalServer) -> int:
    """Run until SIGINT/SIGTERM (then stop the server cleanly) or until the server exits."""
    stop = {"signal": None}

    def handler(signum, _frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with server:
            print(f"serving {server.command.served_name} at {server.url}/v1 (Ctrl-C to stop)", flush=True)
            while stop["signal"] is None and server.proc is not None and server.proc.poll() is None:
                time.sleep(0.5)
            if stop["signal"] is None and server.proc is not None:
                raise ServerError(f"vLLM exited with code {server.proc.returncode}{server.failure_reason()}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print("server stopped", flush=True)
    return 0
