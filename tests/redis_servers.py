"""Real Redis servers on 127.0.0.1 for the remote-tier tests.

`redis-server` comes from Debian's package; `ensure_redis()` installs it
when it is missing (one pytest-xdist worker at a time, under a file lock).
Every server gets its own free port and directory, so tests run in
parallel without sharing a store.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from sidecar_proc import free_port, tmp_dir

_LOCK = "/tmp/kvsidecar-tests-apt.lock"


def ensure_redis() -> None:
    """Install Debian's redis-server (and redis-cli) unless both are on PATH."""
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be installing it right now
        if shutil.which("redis-server") and shutil.which("redis-cli"):
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
            subprocess.run(install, env=env, capture_output=True, check=True)
    if not shutil.which("redis-server"):
        raise RuntimeError("redis-server is still missing after installing Debian's package")


class RedisServer:
    """One `redis-server` process; `persist=True` logs every write to an
    append-only file, so a SIGKILLed server restarts with its data."""

    def __init__(self, *, persist: bool = False, cluster: bool = False, tls: bool = False) -> None:
        """`tls=True`: TLS only (a self-signed certificate made with openssl,
        clients not verified); `url` is then a rediss:// one."""
        self.port = free_port()
        self.dir = tmp_dir("redis-")
        self.persist = persist
        self.cluster = cluster
        self.tls = tls
        self.bus_port = free_port() if cluster else 0
        self.proc: subprocess.Popen[bytes] | None = None
        if tls:
            openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
            openssl += ["-subj", "/CN=127.0.0.1", "-keyout", f"{self.dir}/key.pem"]
            openssl += ["-out", f"{self.dir}/cert.pem"]
            subprocess.run(openssl, check=True, capture_output=True)

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}?ssl_cert_reqs=none"
        return f"redis://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        if self.tls:
            cert = f"{self.dir}/cert.pem"
            args = ["redis-server", "--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", cert, "--tls-key-file", f"{self.dir}/key.pem"]
            args += ["--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
            args += ["--bind", "127.0.0.1"]
        else:
            args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", self.dir, "--save", "", "--daemonize", "no", "--loglevel", "warning"]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else []
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.bus_port)]
            args += ["--cluster-config-file", f"nodes-{self.port}.conf"]
        return args

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server (again, on the same port, after kill()). A first
        start whose port another process took between free_port() and the
        server's bind gets new ports, up to 5 times."""
        first = self.proc is None
        for _ in range(5):
            if self._started(timeout):
                return self
            assert self.proc is not None
            if not first or self.proc.poll() is None:
                break  # a restart keeps its port; a live server that never answered
            self.port = free_port()
            self.bus_port = free_port() if self.cluster else 0
        self.kill()
        log = Path(self.dir, "server.log")
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")

    def _started(self, timeout: float) -> bool:
        with open(f"{self.dir}/server.log", "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:  # our process answering, not another server on the same port
                with self.client() as r:
                    if r.info("server")["process_id"] == self.proc.pid:
                        return True
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterOf3:
    """Three masters on loopback joined by `redis-cli --cluster create`."""

    def __init__(self) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> RedisClusterOf3:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-yes"],
            capture_output=True,
            check=True,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while not all(self._ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def keys_per_node(self) -> list[int]:
        """How many keys each master holds."""
        counts = []
        for node in self.nodes:
            with node.client() as r:
                counts.append(r.dbsize())
        return counts

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        with node.client() as r:
            info = r.execute_command("CLUSTER", "INFO").decode()
        return "cluster_state:ok" in info

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
