"""Namespaces from bearer tokens, UNAUTHENTICATED without one, TLS, and the config layering."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import socket
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.test_stream import Sink
from tierkv.cacheserver import config as cfg
from tierkv.cacheserver.auth import bearer
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.protocol import HELLO, pack
from tierkv.cacheserver.frames import put_frames
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.segment import KVSegment

TOKENS = {"token-team-a-0001": "team-a", "token-team-b-0002": "team-b"}


def segment(seed: int, value: float | None = None) -> KVSegment:
    kv = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(seed)).half()
    if value is not None:
        kv.fill_(value)
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=list(range(16)), fingerprint=b"t"
    )


def self_signed(dir: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dir / "cert.pem", dir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(d)
    tokens = ",".join(f"{t}={ns}" for t, ns in TOKENS.items())
    # Tokens through the environment, TLS through flags: both layers in one start.
    s = ServerProcess(
        args=["--tls-cert", str(cert), "--tls-key", str(key)], env={"TIERKV_TOKENS": tokens}
    ).start()
    s.cert = cert
    yield s
    s.stop(kill=True)


def tier(server, token: str | None) -> RemoteTier:
    return RemoteTier(
        target=server.target, token=token, tls_ca=str(server.cert), retries=0, timeout_s=10
    )


async def test_namespaces_isolated(tls_server) -> None:
    a, b = tier(tls_server, "token-team-a-0001"), tier(tls_server, "token-team-b-0002")
    sa, sb = segment(1, 1.0), segment(1, 2.0)  # the same key, different KV
    assert await a.put(sa.key, sa)
    assert await b.contains([sa.key]) == [False] and await b.get(sa.key) is None
    assert [c async for c in b.get_layers(sa.key)] == []
    assert not await b.delete(sa.key)
    assert await b.put(sb.key, sb)
    assert torch.equal((await a.get(sa.key)).payload, sa.payload)
    assert torch.equal((await b.get(sb.key)).payload, sb.payload)
    sta, stb = await a.server_stats(), await b.server_stats()
    assert sta.namespace == "team-a" and stb.namespace == "team-b"
    assert (
        [t.count for t in sta.tiers if t.name == "cpu"] == [1] and sta.puts == 1 and stb.puts == 1
    )
    assert await b.delete(sb.key) and await a.contains([sa.key]) == [True]
    await a.close()
    await b.close()


@pytest.mark.parametrize("token", [None, "wrong-token-0000", "token-team-a-0001x"])
def test_unauthenticated(tls_server, token: str | None) -> None:
    creds = grpc.ssl_channel_credentials(tls_server.cert.read_bytes())
    s = segment(2)
    with grpc.secure_channel(tls_server.target, creds) as ch:
        stub, md = pb_grpc.TierKVStub(ch), bearer(token)
        calls = [
            lambda: stub.Lookup(pb.LookupRequest(keys=[s.key]), metadata=md),
            lambda: stub.Put(put_frames(s.key, s), metadata=md),
            lambda: list(stub.Get(pb.GetRequest(key=s.key), metadata=md)),
            lambda: list(stub.GetMany(pb.GetManyRequest(keys=[s.key]), metadata=md)),
            lambda: stub.Delete(pb.DeleteRequest(keys=[s.key]), metadata=md),
            lambda: stub.Stats(pb.StatsRequest(), metadata=md),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert (
                e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in e.value.details()
            )
        basic = (("authorization", "Basic token-team-a-0001"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(pb.LookupRequest(keys=[s.key]), metadata=basic)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_remote_tier_without_valid_token_misses(tls_server) -> None:
    t = tier(tls_server, "wrong-token-0000")
    s = segment(3)
    assert (
        not await t.put(s.key, s)
        and await t.get(s.key) is None
        and await t.contains([s.key]) == [False]
    )
    assert t.stats().errors >= 3
    await t.close()


async def test_tls_required(tls_server) -> None:
    plain = RemoteTier(target=tls_server.target, token="token-team-a-0001", retries=0, timeout_s=3)
    s = segment(4)
    assert not await plain.put(s.key, s) and await plain.get(s.key) is None
    await plain.close()


def test_config_layers(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text(
        "port: 7001\ncpu_bytes: 2GiB\ndisk_bytes: 1GiB\nredis_url: redis://a:1/0\n"
        "tokens:\n  abcdefgh1: ns1\n"
    )
    p = argparse.ArgumentParser()
    cfg.add_arguments(p)
    env = {"TIERKV_CPU_BYTES": "512MiB", "TIERKV_PORT": "7002", "TIERKV_REDIS_CLUSTER": "true"}
    c = cfg.load(p.parse_args(["--config", str(y), "--port", "7003"]), env)
    assert (c.port, c.tiers.cpu_bytes, c.tiers.disk_bytes, c.tiers.redis_url) == (
        7003,
        512 << 20,
        1 << 30,
        "redis://a:1/0",
    )
    assert (
        c.tiers.redis_cluster
        and c.tokens == {"abcdefgh1": "ns1"}
        and c.auth
        and c.host == "127.0.0.1"
    )
    assert cfg.load(None, {"TIERKV_CONFIG": str(y)}).port == 7001
    d = cfg.load(None, {})
    assert d.host == "127.0.0.1" and not d.auth and d.max_frame_bytes == 1 << 20


@pytest.mark.parametrize(
    "env, words",
    [
        ({"TIERKV_CPU_BYTES": "lots"}, "cpu_bytes"),
        ({"TIERKV_PORT": "70000"}, "port"),
        ({"TIERKV_TOKENS": "short=ns"}, "8 characters"),
        ({"TIERKV_TOKENS": "abcdefgh1=a/b"}, "namespace"),
        ({"TIERKV_TOKENS": "abcdefgh1"}, "TOKEN=NAMESPACE"),
        ({"TIERKV_REDIS_CLUSTER": "maybe"}, "true/false"),
        ({"TIERKV_TLS_CERT": "c.pem"}, "tls_key"),
        ({"TIERKV_MAX_FRAME_BYTES": "8MiB"}, "max_frame_bytes"),
        ({"TIERKV_MAX_STREAMS": "0"}, "max_streams"),
    ],
)
def test_config_refuses(env: dict, words: str) -> None:
    with pytest.raises(cfg.ConfigError, match=words):
        cfg.load(None, env)


def test_config_unknown_yaml_key(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("prot: 1\n")
    with pytest.raises(cfg.ConfigError, match="unknown config keys"):
        cfg.load(None, {"TIERKV_CONFIG": str(y)})


def test_cli_bad_flag_exits_with_message(capsys) -> None:
    from tierkv.cacheserver import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--cpu-bytes", "many"])
    assert e.value.code == 2 and "cpu_bytes" in capsys.readouterr().err


async def test_the_tcp_data_port_speaks_tls_beside_a_tls_control_plane(tls_server) -> None:
    """With TLS on, the TCP data port is TLS too (same certificate): loads, streams and saves go
    through it encrypted, namespaces hold, and a plain client gets no byte of plaintext."""
    a = DataTier(
        target=tls_server.target,
        token="token-team-a-0001",
        tls_ca=str(tls_server.cert),
        shared_memory=False,
    )
    b = DataTier(
        target=tls_server.target,
        token="token-team-b-0002",
        tls_ca=str(tls_server.cert),
        shared_memory=False,
    )
    kv = torch.randn(4, 2, 64, 2, 64).to(torch.bfloat16)
    seg = KVSegment.from_tensor(kv, key=b"t" * 16, tokens=list(range(64)), fingerprint=b"f" * 16)
    assert await a.put(seg.key, seg)
    got = await a.get(seg.key)
    assert got is not None and got.verified and torch.equal(got.payload, kv)
    assert await b.get(seg.key) is None  # another namespace
    sink = Sink(2)
    await a.stream([seg.key, b"u" * 16], "default", sink)
    assert sink.dropped == {1: "miss"} and torch.equal(sink.payload(0), kv)
    assert a._session is not None and a._session.conn.tls is not None  # over TLS, not gRPC
    assert a.stats().errors == 0
    port = (await a.stub.DataPlane(pb.DataPlaneRequest(), **a._opts())).tcp_port
    await a.close()
    await b.close()
    with socket.create_connection(("127.0.0.1", port), 10) as sock:
        sock.settimeout(10)
        sock.sendall(pack(HELLO, 0, b"token-team-a-0001"))  # plaintext: not a TLS hello
        try:
            reply = sock.recv(4096)
        except ConnectionResetError:
            reply = b""
        assert reply[:1] != b"\x00"  # no session's answer (status OK is 0); at most a TLS alert
