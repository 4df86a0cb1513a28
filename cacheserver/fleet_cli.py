"""`tierkv-fleet`: a fleet on this host (cacheserver/fleet.py) until Ctrl-C.

tierkv-fleet --model ./SmolLM2 --replicas 2 --policy kv_aware
tierkv-fleet --model ./SmolLM2 --pd                     # 1 prefill + 1 decode replica
tierkv-fleet --model ./SmolLM2 --nodes 2                # 2 servers over a Redis Cluster
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tierkv.cacheserver.fleet import Fleet, FleetConfig
from tierkv.storage_backends.knobs import field_docs, knob_help

POLICIES = ["round_robin", "random", "power_of_two", "consistent_hash", "cache_aware", "kv_aware"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("tierkv-fleet", description=__doc__.split("\n")[0])
    docs = field_docs(FleetConfig)
    for f in dataclasses.fields(FleetConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = docs[f.name] + " (required)" if f.name == "model" else knob_help(FleetConfig, f.name)
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=doc)
        elif f.name == "model":
            p.add_argument(flag, required=True, help=doc)
        else:
            kind: Any = int if f.type == "int" else Path if f.name == "log_dir" else str
            choices = POLICIES if f.name == "policy" else None
            p.add_argument(flag, type=kind, choices=choices, help=doc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    cfg = FleetConfig(**{k: v for k, v in args.items() if v is not None})
    fleet = Fleet(cfg)
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        fleet.start()
        print(f"tierkv-fleet: router {fleet.url}, model {cfg.served_name!r}, logs {cfg.log_dir}")
        for n, s in enumerate(fleet.servers):
            print(f"  server{n}  grpc://127.0.0.1:{s.port}")
        for i, r in enumerate(fleet.replicas):
            print(f"  replica{i} {r.url} {fleet.role(i)} {fleet.events.get(r.url, '')}")
        sys.stdout.flush()
        while not stop:
            dead = [p.name for p in [*fleet.servers, *fleet.replicas] if not p.alive()]
            if dead:
                print(f"tierkv-fleet: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
