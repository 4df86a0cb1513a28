"""One engine process with a connector to a cache server, for the cross-process tests:
`python -m tests.conn_worker TARGET SEED N` prints {"tokens", "metrics"} as JSON."""

from __future__ import annotations

import dataclasses
import json
import sys

from tests.test_connector import CHUNK, GREEDY, engine, tokens
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.storage_backends.build import TiersConfig


def main() -> None:
    target, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    conn = TierKVConnector(
        ConnectorConfig(
            chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="16MiB"), remote=f"grpc://{target}"
        )
    )
    out = engine(conn).generate([tokens(n, seed)], GREEDY, use_tqdm=False)[0]
    conn.close()  # flushes: every save has reached the server
    print(json.dumps({"tokens": out.token_ids, "metrics": dataclasses.asdict(out.metrics)}))


if __name__ == "__main__":
    main()
