"""Test support for the agent channel: a real AgentServer writing a real capture, real child processes."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.daemon.agents.server import AgentServer
from gputrace.daemon.writer import QueueSink

PYTHON = sys.executable


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without gputrace's variables or PYTHONPATH (an unarmed process's), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_") and k != "PYTHONPATH"}
    return {**env, **extra}


class Harness:
    """An AgentServer started with a QueueSink over a CaptureWriter, as the capture session does."""

    def __init__(self, tmp: Path, **server_kw: Any) -> None:
        self.tmp = tmp
        self.allowed: set[int] = set()
        server_kw.setdefault("authorize", self.allowed.__contains__)
        server_kw.setdefault("attach_dir", str(tmp / "attach"))
        self.server = AgentServer(tmp / "agent.sock", **server_kw)
        self.path = tmp / "cap.gputrace"
        self.writer = CaptureWriter(self.path, host_header(["test"]))
        self.sink = QueueSink(self.writer)
        self.server.start(self.sink)
        self.procs: list[subprocess.Popen[str]] = []
        self.reader: CaptureReader | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
        return {**env, **self.server.child_env(env), **extra}

    def spawn(self, code: str, *args: str, env: dict[str, str] | None = None,
              stdin: bool = False) -> subprocess.Popen[str]:
        script = self.tmp / f"w{len(self.procs)}.py"
        script.write_text(code)
        p = subprocess.Popen([PYTHON, str(script), *args], env=env or self.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None, text=True)
        self.allowed.add(p.pid)
        self.procs.append(p)
        return p

    def finish(self) -> list[tuple[Any, ...]]:
        self.server.stop()  # a second call (after a test's own) does nothing
        self.sink.close()
        self.writer.close({"drops": {f"agent.{k}": v for k, v in self.server.drops().items()}})
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()  # type: ignore[union-attr]
            p.stderr.close()  # type: ignore[union-attr]
        self.reader = CaptureReader(self.path)
        records = list(self.reader.records())
        self.reader.close()
        return records


def of(records: list[tuple[Any, ...]], kind: str) -> list[Any]:
    return [r for r in records if type(r).__name__ == kind]


class RawPeer:
    """A hand-driven client of the agent socket, to say what no real agent would."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(5.0)

    def send(self, msg: Any) -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        self.raw(struct.pack(">I", len(body)) + body)

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, pid: int | None = None) -> dict[str, Any]:
        self.send({"type": "hello", "pid": os.getpid() if pid is None else pid, "tid": 1, "interpreter": "test",
                   "cuda_version": "", "driver_version": "", "backends": ["sim"], "unavailable": {}})
        return self.recv()

    def recv(self) -> dict[str, Any]:
        n = struct.unpack(">I", self._exactly(4))[0]
        return msgpack.unpackb(self._exactly(n), raw=False)  # type: ignore[no-any-return]

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("server closed the connection")
            buf += chunk
        return buf

    def closed_by_server(self, timeout_s: float = 5.0) -> bool:
        self.sock.settimeout(timeout_s)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
