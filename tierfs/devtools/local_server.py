"""The life cycle the throwaway servers of tests and the demo share (SeaweedFS, etcd).

A `LocalServer` runs one binary on free 127.0.0.1 ports in its own data dir, logs to a file
there (never to the test output), waits until the server answers, and stops it by its own pid
only: SIGTERM, then SIGKILL after a grace period. `restart()` keeps the ports and the data, so
a test can take the server away and bring it back at the same endpoint. A subclass says which
ports it needs, its command line and how to tell that it is ready.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Self

LOOPBACK = "127.0.0.1"
MAX_PORT = 45000  # weed derives unset grpc ports as port+10000; they must stay below 65536


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports below MAX_PORT, chosen by the kernel."""
    with ExitStack() as stack:
        ports: list[int] = []
        for _ in range(50 * count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
            if port < MAX_PORT:
                ports.append(port)
                if len(ports) == count:
                    return ports
    raise RuntimeError(f"could not find {count} free ports below {MAX_PORT}")


class LocalServer:
    """One server process on loopback; see the module docstring."""

    PORT_NAMES: Sequence[str] = ()  # the ports `command()` uses, chosen at the first start
    LOG_NAME = "server.log"
    STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
    START_TIMEOUT = 60.0

    def __init__(self, data_dir: Path, nice: int = 0) -> None:
        self.data_dir = Path(data_dir)
        self.nice = nice  # added to the server's nice value (the bench: a store "elsewhere")
        self.log_path = self.data_dir / self.LOG_NAME
        self.ports: dict[str, int] = {}  # fixed once chosen, so the endpoint never changes
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this run's part of the (appended) log begins

    # -- what a subclass provides -------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Return once the server answers; raise RuntimeError (with `log_tail()`) if it
        exits or does not answer within `timeout` seconds."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Files the server needs before each start (configuration)."""

    def after_stop(self) -> None:
        """Tidy what the stopped process may have left outside its data dir."""

    def log_tail(self, lines: int = 20) -> str:
        """The end of this run's part of the log, to append to an error message."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        tail = self.log_records(text.splitlines())[-lines:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def log_records(self, lines: list[str]) -> list[str]:
        """The lines of the log worth showing (all of them unless a subclass knows better)."""
        return lines

    # -- the life cycle -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float | None = None) -> None:
        """Start the server and return once it is ready.

        The first start picks free ports (retrying if one is taken meanwhile); later starts
        reuse them.
        """
        if self._proc is not None:
            raise RuntimeError(f"{type(self).__name__} already running (pid {self._proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.prepare()
        fresh_ports = not self.ports
        for attempt in range(3 if fresh_ports else 1):
            if fresh_ports:
                self.ports.update(zip(self.PORT_NAMES, free_ports(len(self.PORT_NAMES)),
                                      strict=True))
            try:
                self._launch(self.START_TIMEOUT if timeout is None else timeout)
                return
            except RuntimeError as error:
                if not (fresh_ports and "address already in use" in str(error)) or attempt == 2:
                    raise

    def stop(self) -> None:
        """SIGTERM the server by pid, SIGKILL it after STOP_GRACE s, wait for exit. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.after_stop()

    def restart(self) -> None:
        """Stop, then start again on the same ports and data dir (the data survives)."""
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _launch(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(self.command(), cwd=self.data_dir,
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT,
                                          preexec_fn=(lambda: os.nice(self.nice))
                                          if self.nice else None)
        try:
            self.wait_ready(self._proc, timeout)
        except BaseException:
            self.stop()
            raise

    def poll_until(self, proc: subprocess.Popen[bytes], timeout: float, what: str,
                   answers: Callable[[], object]) -> None:
        """Call `answers()` every 50 ms until it returns None (ready); it returns an error
        (or raises OSError/ValueError) while the server is not ready."""
        deadline = time.monotonic() + timeout
        last_error: object = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}{self.log_tail()}")
            try:
                last_error = answers()
            except Exception as error:  # not listening yet
                last_error = error
            if last_error is None:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready within {timeout} s ({last_error})"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
