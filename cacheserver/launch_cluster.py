"""A Redis Cluster of redis-server processes (launch.RedisProcess) on free ports of 127.0.0.1,
for tests and the fleet."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field

from tierkv.cacheserver.launch import RedisProcess, free_port


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class RedisCluster:
    """A Redis Cluster of `masters` redis-server processes (each with `replicas` replicas).

    Nodes are RedisProcess objects in cluster mode, so a caller can kill or restart one (a
    master killed, its replica takes over).
    """

    masters: int = 3
    replicas: int = 0
    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def cluster_url(self) -> str:
        """Every node as a startup node: the client finds the cluster through any live one."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{hosts}/0"

    def start(self, timeout: float = 20.0) -> RedisCluster:
        flags = ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
        flags += ["--cluster-config-file", "nodes.conf"]
        for _ in range(self.masters * (1 + self.replicas)):
            self.nodes.append(RedisProcess(port=_cluster_port(), extra=list(flags)).start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while not all(self._ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _ok(node: RedisProcess) -> bool:
        out = subprocess.run(
            ["redis-cli", "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        return "cluster_state:ok" in out

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)
        self.nodes.clear()
