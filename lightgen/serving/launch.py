"""``lightgen serve`` in a subprocess, for tests and benchmarks: started on free loopback ports, ready
when its health endpoint answers, stopped by SIGTERM, and checked to leave no process or workspace behind."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightgen.serving.client import Client

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess("ray", ["--max-batch-size", "16"]) as client: client.generate(...)``.

    ``stop_signal``: how it is stopped; ``sigint_ignored``: start it as a shell starts a background job
    (SIGINT ignored, inherited). On exit: ``leftovers`` (processes started under the server still running
    after the stop signal; killed), ``workspaces`` (PyTriton workspaces not removed), ``returncode`` and
    ``output`` (the server's log).
    """

    def __init__(self, backend: str, args: list[str] = (), startup_timeout_s: float = 240.0,
                 stop_signal: int = signal.SIGTERM, sigint_ignored: bool = False) -> None:
        self.backend, self.args, self.startup_timeout_s = backend, list(args), startup_timeout_s
        self.stop_signal, self.sigint_ignored = stop_signal, sigint_ignored
        self.leftovers, self.workspaces, self.returncode, self.output = [], [], None, ""
        self.stopping = False

    def __enter__(self) -> Client:
        import psutil

        # Short: Ray's socket paths live under it and must stay under 107 characters.
        self.home = tempfile.mkdtemp(prefix="lgserve")
        port = free_port()
        command = [sys.executable, "-m", "lightgen.cli", "serve", "--backend", self.backend, "--port", str(port)]
        if self.backend == "triton":
            command += ["--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
        # A token of its own for Ray's token authentication: else Ray writes one to ~/.ray/auth_token.
        env = dict(os.environ, PYTRITON_HOME=self.home, RAY_TMPDIR=self.home, RAY_AUTH_TOKEN=secrets.token_hex(32),
                   PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p))
        self.log = open(os.path.join(self.home, "server.log"), "w")
        self.process = subprocess.Popen(command + self.args, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=self._ignore_sigint if self.sigint_ignored else None)
        client = Client(f"http://127.0.0.1:{port}", self.backend)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not client.ready():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.backend} server did not become ready")
                time.sleep(0.5)
        except BaseException as error:
            self._stop(psutil.Process(self.process.pid).children(recursive=True) if self.process.poll() is None
                       else [])
            raise RuntimeError(f"{error}; its log:\n{self.output[-3000:]}") from error
        self.started = psutil.Process(self.process.pid).children(recursive=True)
        return client

    def processes(self) -> list:
        """The server's process and every process under it now (psutil.Process objects)."""
        import psutil

        root = psutil.Process(self.process.pid)
        return [root] + root.children(recursive=True)

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process tree."""
        import psutil

        total = 0
        for process in self.processes():
            try:
                total += process.memory_info().rss
            except psutil.Error:  # exited meanwhile
                pass
        return total

    def listening(self) -> list[tuple[str, str, int]]:
        """(process name, address, port) of every TCP socket the server's process tree listens on."""
        import psutil

        sockets = []
        for process in self.processes():
            try:
                name, connections = process.name(), process.net_connections(kind="inet")
            except psutil.Error:
                continue
            sockets += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
        return sockets

    def stop(self) -> None:
        """Send the stop signal now, inside the ``with`` block (once); leaving the block waits and checks."""
        if not self.stopping:
            self.stopping = True
            self.process.send_signal(self.stop_signal)

    @staticmethod
    def _ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *_) -> None:
        self._stop(self.started)

    def _stop(self, started) -> None:
        import psutil

        self.stop()
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        time.sleep(2)  # Ray's agents exit shortly after the driver
        self.leftovers = [(p.pid, p.name()) for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for pid, _ in self.leftovers:
            os.kill(pid, signal.SIGKILL)
        self.workspaces = sorted(p.name for p in Path(self.home).glob("workspace_*"))
        self.log.close()
        self.output = Path(self.log.name).read_text()
        self.returncode = self.process.returncode
        shutil.rmtree(self.home, ignore_errors=True)
