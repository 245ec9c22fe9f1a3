"""Real Redis servers for tests: standalone and a 3-node cluster, on loopback ports they pick, stopped after."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT = 20.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one whose bus port (+10000) is free and valid too."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class Server:
    """One redis-server on 127.0.0.1 (and a Unix socket), in a private temp dir."""

    def __init__(self, port: int | None = None, cluster: bool = False, password: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cctest-redis-"))
        self.port = port or free_port(cluster)
        self.socket = str(self.dir / "redis.sock")
        self.cluster = cluster
        self.password = password
        self.proc: subprocess.Popen | None = None
        try:
            self.start()
        except BaseException:
            self.stop()  # a server that did not start leaves no directory behind
            raise

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket", self.socket,
                "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--loglevel", "warning"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)

    def wait_ready(self) -> None:
        """Until the server answers PING (a server start, with a deadline; not a test's effect)."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with self.client(socket_timeout=1) as c:
                    c.ping()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """Three masters, no replicas, joined with `redis-cli --cluster create`."""

    def __init__(self) -> None:
        self.nodes: list[Server] = []
        try:
            for _ in range(3):
                self.nodes.append(Server(cluster=True))  # a node that fails stops the ones already up
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            deadline = time.monotonic() + START_TIMEOUT
            while any(n.client().cluster("info").get("cluster_state") != "ok" for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach state ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
