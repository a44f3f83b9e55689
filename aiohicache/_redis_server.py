"""Throwaway ``redis-server`` processes on free loopback ports, for the tests and benchmarks.

    with RedisServer(password="s3cret") as server:
        backend = RedisBackend(server.url(db=1), fmt)
    with LocalCluster() as cluster:       # 3 primaries + 3 replicas, redis-cli --cluster create
        backend = RedisClusterBackend(cluster.url(), fmt)

Nothing is persisted: the server runs in a temporary directory with snapshots and the append
only file off, and the directory is removed when it stops.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

__all__ = ("LocalCluster", "RedisServer", "RedisServerError")

_HOST = "127.0.0.1"
_START_ATTEMPTS = 5  # a free port can be taken between choosing it and binding it
_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


class RedisServerError(RuntimeError):
    """redis-server is missing, or did not start; the message says which and why."""


class RedisServer:
    """One ``redis-server`` process owned by this object (sync: it only spawns and waits).

    `start` picks a free port, runs the server with ``--bind 127.0.0.1 --save ""
    --appendonly no`` in a temporary directory and waits until it answers ``INFO`` with its
    own process id (so a password goes in `password`, not in ``extra_args``); `stop` ends
    it. `kill`, `pause` and `resume` simulate failures (SIGKILL, SIGSTOP, SIGCONT).
    """

    def __init__(self, *, password: str | None = None, executable: str = "redis-server",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.password = password
        """Set with ``--requirepass`` (the default user's password) when not None."""
        self.executable = executable
        self.extra_args = extra_args
        self.port = 0
        self.tls_port: int | None = None
        """Set before `start` (to 0: any free port) to listen for TLS there (``--tls-port``);
        then ``extra_args`` must name the certificate files."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer {_HOST}:{self.port} {state}>"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def url(self, *, db: int = 0, username: str | None = None,
            password: str | None = None) -> str:
        """A ``redis://`` URL of this server; `password` defaults to the server's."""
        password = self.password if password is None else password
        auth = ""
        if password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        return f"redis://{auth}{_HOST}:{self.port}/{db}"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers, as itself (its process id).

        Raises:
            RedisServerError: redis-server is not installed, or did not come up in `timeout`.
        """
        if self.running:
            raise RuntimeError("the server is already running")
        path = shutil.which(self.executable)
        if path is None:
            raise RedisServerError(
                f"{self.executable!r} not found on PATH: install it (Debian/Ubuntu: apt-get "
                "install redis-server); the Redis tests and benchmark need a real server")
        self._dir = tempfile.TemporaryDirectory(prefix="aiohicache-redis-")
        try:
            for _ in range(_START_ATTEMPTS):
                if self._spawn(path, timeout):
                    return
        except BaseException:  # NOTE: Ctrl-C while it waited left the server running
            self.stop()
            raise
        tail = self._log_tail()
        self.stop()
        raise RedisServerError(f"redis-server did not start: {tail}")

    def _spawn(self, path: str, timeout: float) -> bool:
        """One try on a fresh port: True once it answers, False if the port was taken."""
        assert self._dir is not None
        self.port = (_free_cluster_port() if "--cluster-enabled" in self.extra_args
                     else _free_port())
        tls: tuple[str, ...] = ()
        if self.tls_port is not None:
            self.tls_port = _free_port()
            tls = ("--tls-port", str(self.tls_port))
        args = [path, "--port", str(self.port), *tls, "--bind", _HOST, "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--logfile", "redis.log",
                *(("--requirepass", self.password) if self.password is not None else ()),
                *self.extra_args]
        with open(Path(self._dir.name, "stderr.log"), "ab") as err:  # errors before the log
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=err,
                                          stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:  # exited: most likely the port was taken
                self._proc = None
                return False
            # NOTE: whose answer, not just an answer: another process's server may take the
            # port between _free_port and our bind; ours then exits, but the port answers
            if _pid_on(self.port, self.password) == self._proc.pid:
                return True
            time.sleep(0.01)
        tail = self._log_tail()
        self.stop()
        raise RedisServerError(f"redis-server gave no answer within {timeout} s: {tail}")

    def _log_tail(self) -> str:
        """The last lines the server wrote (its log, and stderr for errors before it)."""
        if self._dir is None:
            return "(no log)"
        lines: list[str] = []
        for name in ("stderr.log", "redis.log"):
            path = Path(self._dir.name, name)
            if path.exists():
                lines += path.read_text(errors="replace").splitlines()[-5:]
        return " | ".join(line.strip() for line in lines if line.strip()) or "(no log)"

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 5 s) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                _signal(proc, signal.SIGCONT)  # a paused server cannot act on SIGTERM
                proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server (a crash); its port then refuses connections."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (a hang)."""
        if self._proc is not None:
            _signal(self._proc, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            _signal(self._proc, signal.SIGCONT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class LocalCluster:
    """A Redis Cluster of `primaries` x (1 + `replicas`) `RedisServer` processes on loopback.

    `start` runs the servers with ``--cluster-enabled yes`` and a short
    ``--cluster-node-timeout`` (so a replica takes over a killed primary in about two
    timeouts), joins them with ``redis-cli --cluster create`` and waits until every node
    reports ``cluster_state:ok``.
    """

    def __init__(self, *, primaries: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000) -> None:
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0",
                "--cluster-node-timeout", str(node_timeout_ms))
        self.nodes = [RedisServer(extra_args=args) for _ in range(primaries * (1 + replicas))]
        self.replicas = replicas

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def url(self) -> str:
        """``redis+cluster://`` with two seeds (any node would do)."""
        return "redis+cluster://" + ",".join(f"{_HOST}:{n.port}" for n in self.nodes[:2])

    def start(self, timeout: float = 30.0) -> None:
        """Start every node, create the cluster, and wait until it is ok.

        Raises:
            RedisServerError: a server or redis-cli is missing, or the cluster did not form.
        """
        try:
            for node in self.nodes:
                node.start()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RedisServerError("'redis-cli' not found on PATH: install it (Debian/"
                                       "Ubuntu: apt-get install redis-tools)")
            done = subprocess.run(
                [cli, "--cluster", "create", *(f"{_HOST}:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, timeout=timeout, check=False)
            if done.returncode != 0:
                raise RedisServerError(f"redis-cli --cluster create failed: "
                                       f"{done.stdout.decode()[-500:]}")
            self.wait_ok(self.nodes, timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, nodes: list[RedisServer], timeout: float = 30.0) -> None:
        """Wait until each of `nodes` reports ``cluster_state:ok`` and, if a replica, has
        synced with its primary (a replica that never synced cannot take over)."""
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        while pending:
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster is not ok after {timeout} s: "
                                       f"{[n.port for n in pending]}")
            pending = [n for n in pending if not (_cluster_ok(n.port) and _synced(n.port))]
            time.sleep(0.05)

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are primaries now (a promoted replica included)."""
        return [n for n in self.nodes if n.running and _role(n.port) == "master"]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _command(port: int, *words: str) -> str:
    """One inline command's reply (a bulk string's text), or "" if none came."""
    try:
        with socket.create_connection((_HOST, port), timeout=1.0) as sock:
            sock.sendall(" ".join(words).encode() + b"\r\n")
            data = b""
            while not data.endswith(b"\r\n") or data.count(b"\r\n") < 2:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data.decode(errors="replace")
    except OSError:
        return ""


def _cluster_ok(port: int) -> bool:
    return "cluster_state:ok" in _command(port, "CLUSTER", "INFO")


def _role(port: int) -> str:
    return _info_field(port, "replication", "role")


def _synced(port: int) -> bool:
    return _role(port) == "master" or _info_field(port, "replication",
                                                  "master_link_status") == "up"


def _info_field(port: int, section: str, name: str) -> str:
    for line in _command(port, "INFO", section).splitlines():
        if line.startswith(f"{name}:"):
            return line.partition(":")[2].strip()
    return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+ 10000) is a port, and free too.

    NOTE: the kernel hands out ports up to 60999, and a cluster node on a port over 55535
    exits at once (its bus port would be past 65535), as one whose bus port is taken does:
    each such pick cost one of the `_START_ATTEMPTS`, and now and then a node did not start
    """
    while True:
        port = _free_port()
        if port + _BUS_OFFSET <= 65535 and _bindable(port + _BUS_OFFSET):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
        return True


_PROCESS_ID = re.compile(rb"\r\nprocess_id:(\d+)\r\n")
_ERROR_REPLY = re.compile(rb"(?:^|\r\n)-[^\r]*\r\n")
"""A RESP error reply (``-NOAUTH ...``); no line of INFO's text starts with a dash."""


def _pid_on(port: int, password: str | None) -> int | None:
    """The process id of the server on `port` (``INFO server``, after ``AUTH`` with
    `password`), or None if it gave none (refused, another password, not Redis)."""
    words = [["AUTH", password]] if password is not None else []
    request = b"".join(map(_resp, [*words, ["INFO", "server"]]))
    data = b""
    try:
        with socket.create_connection((_HOST, port), timeout=1.0) as sock:
            sock.sendall(request)
            while not (_PROCESS_ID.search(data) or _ERROR_REPLY.search(data)):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    found = _PROCESS_ID.search(data)
    return int(found.group(1)) if found else None


def _resp(words: list[str]) -> bytes:
    """A command as a RESP array: a password may hold spaces an inline command would split."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
