"""A client of LMCache's lm:// server (its `lmcache_server`), run by bench.tcp_port with the
python of `.venv-lmcache` (LMCache is a baseline there, never a dependency of tierkv).

Reads `ROUND <bytes> <reps>` lines on stdin; for each, puts `reps` values of that many bytes
under fresh keys (timed until an EXIST after them is answered: a PUT has no reply), gets each
back into one preallocated buffer (the first compared byte for byte with what was put), and
prints a JSON line {"put_s": seconds per put, "get_s": median seconds per get}. The wire
messages are LMCache's own (lmcache.v1.protocol), so this is what its remote connector sends.

    .venv-lmcache/bin/python bench/lmcache_driver.py HOST PORT
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        got += n


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fmt = MemoryFormat.KV_2LTD
    serial = 0
    for line in sys.stdin:
        _, nbytes_s, reps_s = line.split()
        nbytes, reps = int(nbytes_s), int(reps_s)
        value = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        data = memoryview(value.numpy()).cast("B")
        shape = torch.Size([nbytes // 2])
        out = bytearray(nbytes)
        gets, keys = [], []
        t0 = time.perf_counter()
        for _ in range(reps):
            serial += 1
            key = CacheEngineKey("bench", 1, 0, serial, torch.float16)
            keys.append(key)
            meta = ClientMetaMessage(ClientCommand.PUT, key, nbytes, fmt, torch.float16, shape)
            sock.sendall(meta.serialize())
            sock.sendall(data)
        # A PUT has no reply; the server serves a connection's requests in order, so the
        # answer to an EXIST after them says every put was stored.
        exist = ClientMetaMessage(ClientCommand.EXIST, keys[-1], 0, fmt, torch.float16, shape)
        sock.sendall(exist.serialize())
        head = bytearray(ServerMetaMessage.packlength())
        recv_into(sock, memoryview(head))
        put_s = (time.perf_counter() - t0) / reps
        for i, key in enumerate(keys):
            meta = ClientMetaMessage(ClientCommand.GET, key, 0, fmt, torch.float16, shape)
            t0 = time.perf_counter()
            sock.sendall(meta.serialize())
            head = bytearray(ServerMetaMessage.packlength())
            recv_into(sock, memoryview(head))
            reply = ServerMetaMessage.deserialize(bytes(head))
            if reply.length != nbytes:
                raise RuntimeError(f"lm:// answered {reply.length} bytes for {nbytes}")
            recv_into(sock, memoryview(out))
            gets.append(time.perf_counter() - t0)
            if i == 0 and bytes(out) != bytes(data):
                raise RuntimeError("lm:// returned other bytes than were put")
        print(json.dumps({"put_s": put_s, "get_s": statistics.median(gets)}), flush=True)


if __name__ == "__main__":
    main()
