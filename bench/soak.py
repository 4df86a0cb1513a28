"""Soak: `python -m bench.soak [--duration 60] [--quick]`.

8 clients run mixed Lookup/Put/Get/Stream/Delete against a real tierkv-server (cpu, disk
and redis tiers): 4 over gRPC (RemoteTier), 2 over its shared-memory data plane and 2 over
its TCP data port (DataTier), a stream being one layer-major load of 4 keys, while faults
are injected on a schedule: Redis SIGKILLed and
restarted, the server SIGKILLed and restarted on the same cache directory, the server
SIGTERMed and restarted. Every payload is a function of its key, so each client checks
every byte it gets back. After the fault phase come two fault-free periods of equal
length: the server's RSS at the end of the second must not exceed the first (no leak).

Durable, precisely: a segment whose file the disk tier had fsynced and renamed into place
(`cache_dir/disk/default/<key>.tkv`) when the server process ended. The harness lists
those files while the server is down (so the list is final), parks the clients, restarts
the server and checks that every listed key is found and every byte verifies before the
clients resume. `lost` counts listed keys missing or wrong.

Memory: peak RSS must stay under the idle server's RSS + cpu capacity + receive pool +
OVERHEAD (gRPC buffers and segments in flight: 8 clients x a few 128 KiB copies).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch
import xxhash
from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.launch import RedisProcess, ServerProcess
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.sizes import MiB

CLIENTS, SLOTS = 8, 64  # each client owns SLOTS keys: 512 x 128 KiB = 64 MiB, over the cpu tier
SHAPE = (4, 2, 64, 2, 64)  # fp16: 128 KiB per segment
CPU, DISK, INFLIGHT, OVERHEAD = 32 * MiB, 256 * MiB, 64 * MiB, 128 * MiB
BIN = 0.5  # seconds per throughput bin


def key_of(client: int, slot: int) -> bytes:
    return xxhash.xxh3_128_digest(f"soak:{client}:{slot}".encode())


def payload_of(key: bytes) -> torch.Tensor:
    """The bytes a key names: anyone can recompute them, so every get is checked."""
    raw = np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(int(np.prod(SHAPE)) * 2)
    return torch.frombuffer(bytearray(raw), dtype=torch.float16).view(SHAPE)


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def segment_of(key: bytes) -> KVSegment:
    return KVSegment.from_tensor(
        payload_of(key), key=key, tokens=range(SHAPE[2]), fingerprint=b"soak"
    )


@dataclass(slots=True)
class Check:
    """A stream's sink that checks every layer made ready against the bytes its key names."""

    keys: list[bytes]
    bufs: dict[bytes, torch.Tensor] = field(default_factory=dict)
    dropped: set[bytes] = field(default_factory=set)
    want: dict[bytes, torch.Tensor] = field(default_factory=dict)
    wrong: int = 0
    nbytes: int = 0

    def open(self, i: int, h: SegmentHeader) -> bool:
        if (h.num_layers, 2, h.num_tokens, h.num_kv_heads, h.head_dim) != SHAPE:
            self.wrong += int(np.prod(SHAPE)) * 2
            return False
        self.bufs[self.keys[i]] = torch.empty(SHAPE, dtype=torch.float16)
        self.want[self.keys[i]] = payload_of(self.keys[i])
        return True

    def into(self, i: int, layer: int) -> memoryview:
        return flat(self.bufs[self.keys[i]][layer]).numpy().data

    def drop(self, i: int, why: str) -> None:
        self.dropped.add(self.keys[i])
        self.bufs.pop(self.keys[i], None)

    async def ready(self, layer: int) -> None:
        for k, buf in self.bufs.items():
            want, have = flat(self.want[k][layer]), flat(buf[layer])
            self.wrong += int((have != want).sum())
            self.nbytes += want.numel()


@dataclass(slots=True)
class Tally:
    ops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    wrong_bytes: int = 0
    done: list[float] = field(default_factory=list)  # completion time of every op

    def op(self, kind: str) -> None:
        self.ops[kind] = self.ops.get(kind, 0) + 1
        self.done.append(time.monotonic())

    def err(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


@dataclass(slots=True)
class Soak:
    server: ServerProcess
    redis: RedisProcess
    tally: Tally = field(default_factory=Tally)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    parked: int = 0
    stop: bool = False
    segs: dict[bytes, KVSegment] = field(default_factory=dict)
    rss: list[tuple[float, int]] = field(default_factory=list)
    lost: int = 0
    durable_checked: int = 0

    async def client(self, c: int) -> None:
        tier = (
            RemoteTier(target=self.server.target, timeout_s=5.0, retries=3)
            if c < CLIENTS // 2
            else DataTier(
                target=self.server.target, timeout_s=5.0, retries=3, shared_memory=c % 2 == 0
            )
        )
        rng, stored = np.random.default_rng(c), set()
        while not self.stop:
            if not self.go.is_set():
                self.parked += 1
                await self.go.wait()
                self.parked -= 1
                continue
            try:
                await self.one(
                    tier, key_of(c, int(rng.integers(SLOTS))), rng.random(), rng, c, stored
                )
            except Exception as e:  # the contract says never; count it if it happens
                self.tally.err(f"exception:{type(e).__name__}")
        for _ in range(tier.stats().errors):
            self.tally.err("rpc failed (miss or False)")
        await tier.close()

    async def one(
        self, tier: RemoteTier | DataTier, key: bytes, r: float, rng, c: int, stored: set
    ) -> None:
        t = self.tally
        if r < 0.3:
            seg = self.segs[key]
            if await tier.put(key, seg):
                stored.add(key)
                t.bytes += seg.payload.numel() * 2
            else:
                t.err("put refused")
            t.op("put")
        elif r < 0.6:
            keys = [key] + [key_of(c, int(s)) for s in rng.integers(SLOTS, size=3)]
            sink = Check(list(dict.fromkeys(keys)))
            await tier.stream(sink.keys, "default", sink)
            for k in sink.keys:
                if k not in sink.bufs and k in stored and k not in sink.dropped:
                    t.err("stream: key neither delivered nor dropped")
                elif k in sink.dropped and k in stored:
                    t.err("miss of a stored key")
            t.wrong_bytes += sink.wrong
            t.bytes += sink.nbytes
            t.op("stream")
        elif r < 0.7:
            got = await tier.get(key)
            if got is None:
                if key in stored:
                    t.err("miss of a stored key")
            else:
                want = flat(self.segs[key].payload)
                have = (
                    flat(got.payload)
                    if got.payload.shape == SHAPE and got.header.dtype == "float16"
                    else None
                )
                t.wrong_bytes += want.numel() if have is None else int((have != want).sum())
                t.bytes += want.numel()
            t.op("get")
        elif r < 0.9:
            await tier.contains([key_of(c, int(s)) for s in rng.integers(SLOTS, size=8)])
            t.op("lookup")
        else:
            if await tier.delete(key):
                stored.discard(key)
            t.op("delete")

    async def park(self) -> None:
        self.go.clear()
        while self.parked < CLIENTS:
            await asyncio.sleep(0.01)

    async def sample_rss(self) -> None:
        while not self.stop:
            p = self.server.proc
            if p is not None and p.poll() is None:
                try:
                    self.rss.append((time.monotonic(), psutil.Process(p.pid).memory_info().rss))
                except psutil.Error:
                    pass
            await asyncio.sleep(0.25)

    async def restart_server(self, kill: bool) -> None:
        """Kill (SIGKILL) or stop (SIGTERM) the server, restart it on the same directory and
        check every segment its disk tier had durably written."""
        await asyncio.to_thread(self.server.stop, kill)
        durable = [
            bytes.fromhex(p.stem)
            for p in (self.server.cache_dir / "disk" / "default").glob("*.tkv")
        ]
        await asyncio.sleep(1.0)  # the clients keep trying against a dead server
        await self.park()
        await asyncio.to_thread(self.server.start)
        check = RemoteTier(target=self.server.target, timeout_s=10.0, retries=100)
        present = await check.contains(durable)
        if check.stats().errors:
            raise RuntimeError(
                "the restarted server did not answer Lookup: cannot check durability"
            )

        async def verify(k: bytes, p: bool) -> bool:
            got, want = (await check.get(k) if p else None), self.segs.get(k)
            return (
                got is not None
                and want is not None
                and torch.equal(flat(got.payload), flat(want.payload))
            )

        for i in range(0, len(durable), 16):
            part = durable[i : i + 16]
            self.lost += sum(
                not ok for ok in await asyncio.gather(*map(verify, part, present[i : i + 16]))
            )
        self.durable_checked += len(durable)
        await check.close()
        self.go.set()

    async def restart_redis(self) -> None:
        await asyncio.to_thread(self.redis.stop, True)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(self.redis.start)


def rate(done: np.ndarray, a: float, b: float) -> float:
    return float(((done >= a) & (done < b)).sum() / max(b - a, 1e-9))


async def run(duration: float, quick: bool) -> tuple[list[dict], list[dict], dict]:
    redis = RedisProcess().start()
    server = ServerProcess(
        args=[
            "--cpu-bytes",
            str(CPU),
            "--disk-bytes",
            str(DISK),
            "--max-inflight-bytes",
            str(INFLIGHT),
            "--redis-url",
            redis.url,
            "--redis-timeout-s",
            "0.5",
        ]
    ).start()
    await asyncio.sleep(1.0)
    idle_rss = psutil.Process(server.proc.pid).memory_info().rss
    s = Soak(server, redis)
    for c in range(CLIENTS):  # deterministic payloads, made before the clock starts
        for slot in range(SLOTS):
            s.segs[key_of(c, slot)] = segment_of(key_of(c, slot))
    # Every key written once before the clock starts, so the pre-fault level is the steady
    # state (cold misses are cheap and would inflate the first seconds).
    warm = RemoteTier(target=server.target)
    keys = list(s.segs)
    for i in range(0, len(keys), 16):
        await asyncio.gather(*(warm.put(k, s.segs[k]) for k in keys[i : i + 16]))
    await warm.close()
    s.go.set()
    sched = (
        [(0.3, "redis restart"), (0.65, "server SIGKILL")]
        if quick
        else [(0.2, "redis restart"), (0.45, "server SIGKILL"), (0.7, "server SIGTERM")]
    )
    leak = max(4.0, duration / 4)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(s.client(c)) for c in range(CLIENTS)] + [
        asyncio.create_task(s.sample_rss())
    ]
    faults, marks = [], {}
    bar = tqdm(total=int(duration + 2 * leak), desc="soak", unit="s")
    for frac, name in sched:
        await asyncio.sleep(max(0.0, t0 + frac * duration - time.monotonic()))
        start = time.monotonic()
        if name == "redis restart":
            await s.restart_redis()
        else:
            await s.restart_server(kill=name.endswith("KILL"))
        faults.append((name, start - t0, time.monotonic() - t0))
        bar.n = int(time.monotonic() - t0)
        bar.refresh()
    calm = max(
        t0 + duration, t0 + faults[-1][2] + 5.0
    )  # leak periods start once the last fault is over
    for i, phase in enumerate(("fault phase", "leak period 1", "leak period 2")):
        end = calm + i * leak
        while time.monotonic() < end:
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
            bar.n = int(time.monotonic() - t0)
            bar.refresh()
        marks[phase] = end - t0
    bar.close()
    s.stop = True
    s.go.set()
    await asyncio.gather(*tasks)
    server.stop(kill=True)
    redis.stop(kill=True)

    done = np.array(s.tally.done) - t0
    bounds = [0.0, marks["fault phase"], marks["leak period 1"], marks["leak period 2"]]
    rss = np.array([(t - t0, v) for t, v in s.rss])
    fault_rows, prev_end = [], 2.0  # the first 2 s are warm-up
    for j, (name, a, b) in enumerate(faults):
        until = (
            faults[j + 1][1] if j + 1 < len(faults) else bounds[-1]
        )  # recovery must precede the next fault
        lo = max(prev_end, a - 5.0)  # the pre-fault level: up to 5 s before, after the last fault
        pre = rate(done, lo, a)
        # back: the first moment from which 2 s average 80% of the level before (the machine
        # is shared and noisy: single 0.5 s bins swing by 2x with no fault at all)
        back = next(
            (t for t in np.arange(b, until - 2.0, BIN) if rate(done, t, t + 2.0) >= 0.8 * pre), None
        )
        fault_rows.append(
            {
                "fault": name,
                "start_s": round(a, 2),
                "end_s": round(b, 2),
                "pre_ops_s": pre,
                "recovered_after_s": float(back - b) if back is not None else float("inf"),
            }
        )
        prev_end = b
    phase_rows = []
    for i, phase in enumerate(marks):
        a, b = bounds[i], bounds[i + 1]
        in_rss = rss[(rss[:, 0] >= a) & (rss[:, 0] < b)] if len(rss) else rss
        phase_rows.append(
            {
                "phase": phase,
                "seconds": round(b - a, 1),
                "ops": int(((done >= a) & (done < b)).sum()),
                "ops_s": rate(done, a, b),
                "peak_rss_MiB": float(in_rss[:, 1].max() / MiB),
                "end_rss_MiB": float(in_rss[-4:, 1].mean() / MiB),
            }
        )
    summary = {
        "ops": s.tally.ops,
        "errors": s.tally.errors,
        "MiB": s.tally.bytes / MiB,
        "wrong_bytes": s.tally.wrong_bytes,
        "lost_durable": s.lost,
        "durable_checked": s.durable_checked,
        "faults": len(faults),
        "idle_rss_MiB": idle_rss / MiB,
        "rss_bound_MiB": (idle_rss + CPU + INFLIGHT + OVERHEAD) / MiB,
        "bins": [[float(t), rate(done, t, t + BIN)] for t in np.arange(0, bounds[-1], BIN)],
        "rss": [[float(t), float(v / MiB)] for t, v in rss],
        "fault_windows": faults,
        "bounds": bounds,
    }
    return phase_rows, fault_rows, summary


def main() -> None:
    p = parser("Soak: 8 clients, mixed ops, faults on a schedule, every byte verified")
    p.add_argument("--duration", type=float, default=None, help="seconds of the fault phase")
    p.add_argument("--fleet", action="store_true", help="the fleet soak (bench/soak_fleet.py)")
    args = p.parse_args()
    if args.fleet:
        from bench.soak_fleet import run_fleet_soak

        return run_fleet_soak(30.0 if args.quick else args.duration or 120.0, args.quick)
    logging.getLogger("tierkv.remote").setLevel(logging.ERROR)  # counted in the table instead
    duration = 16.0 if args.quick else args.duration or 60.0
    phases, faults, s = asyncio.run(run(duration, args.quick))
    print_table(phases)
    print_table(faults)
    print(
        f"ops {s['ops']}, {s['MiB']:.0f} MiB verified/moved, faults {s['faults']}, "
        f"errors {s['errors']}"
    )
    print(
        f"wrong bytes {s['wrong_bytes']}, durable segments checked {s['durable_checked']}, "
        f"lost {s['lost_durable']}; idle RSS {s['idle_rss_MiB']:.0f} MiB, "
        f"bound {s['rss_bound_MiB']:.0f} MiB"
    )
    peak = max(r["peak_rss_MiB"] for r in phases)
    goals = [
        goal("wrong bytes served", s["wrong_bytes"], "<=", 0, "B"),
        goal("durable segments lost", s["lost_durable"], "<=", 0, "segments"),
        goal(
            "exceptions reaching a client",
            sum(v for k, v in s["errors"].items() if k.startswith("exception")),
            "<=",
            0,
        ),
        goal("peak server RSS", peak, "<=", s["rss_bound_MiB"], "MiB"),
        goal(
            "RSS growth, leak period 2 over 1",
            phases[2]["end_rss_MiB"] - phases[1]["end_rss_MiB"],
            "<=",
            16,
            "MiB",
        ),
    ]
    goals += [
        goal(f"back to 80% throughput after {f['fault']}", f["recovered_after_s"], "<=", 5.0, "s")
        for f in faults
    ]

    def plot(ax) -> None:
        t, r = zip(*s["bins"])
        ax.plot(t, r, label="ops/s (0.5 s bins)")
        for name, a, b in s["fault_windows"]:
            ax.axvspan(a, b, alpha=0.25, color="red")
            ax.text(a, max(r) * 0.95, name, fontsize=7, rotation=90, va="top")
        for x in s["bounds"][1:3]:  # where the two leak periods begin
            ax.axvline(x, color="green", ls="--", lw=0.8)
        ax.set_xlabel("seconds (dashed: leak periods 1 and 2 begin)")
        ax.set_ylabel("ops/s")
        ax2 = ax.twinx()
        rt, rv = zip(*s["rss"])
        ax2.plot(rt, rv, color="gray", lw=0.8, label="server RSS (MiB)")
        ax2.set_ylabel("server RSS (MiB)")
        ax.legend(loc="lower left")

    config = {
        "duration_s": duration,
        "quick": args.quick,
        "clients": CLIENTS,
        "keys": CLIENTS * SLOTS,
        "segment_bytes": int(np.prod(SHAPE)) * 2,
        "cpu_bytes": CPU,
        "disk_bytes": DISK,
        "max_inflight_bytes": INFLIGHT,
        "overhead_bytes": OVERHEAD,
        "summary": {k: v for k, v in s.items() if k not in ("bins", "rss", "bounds")},
    }
    rows = (
        [{"row": "phase", **r} for r in phases]
        + [{"row": "fault", **f} for f in faults]
        + [{"row": "bin", "t_s": t, "ops_s": v} for t, v in s["bins"]]
    )
    write_results("soak", config, rows, goals, plot)


if __name__ == "__main__":
    main()
