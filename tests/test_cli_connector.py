"""`tierkv-engine generate` with the connector flags and document/question files, as a user
runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from tierkv.cacheserver.launch import ServerProcess


def cli(*args: str) -> list[dict]:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierkv.engine.cli",
            "generate",
            "--random-config",
            "tiny",
            "--dtype",
            "fp32",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--chunk-size",
            "32",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_second_process_loads_through_cache_server_and_blends_docs(tmp_path) -> None:
    ids = ",".join(str((i * 7) % 500) for i in range(100))
    docs = []
    for i in range(2):
        docs.append(tmp_path / f"doc{i}.ids")
        docs[-1].write_text(",".join(str((i * 31 + j * 3) % 500) for j in range(40)))
    question = tmp_path / "q.ids"
    question.write_text("5,6,7,8")
    server = ServerProcess().start()
    try:
        first = cli("--cache-server", server.target, "--cpu-cache", "0", "--prompt-ids", ids)[0]
        second = cli("--cache-server", server.target, "--cpu-cache", "0", "--prompt-ids", ids)[0]
        assert first["external_tokens"] == 0 and second["external_tokens"] == 99  # all but the last
        assert first["token_ids"] == second["token_ids"]
        files = ["--doc", str(docs[1]), "--doc", str(docs[0]), "--question", str(question), "--ids"]
        # a random model has no calibration: blend by the engine's knobs (this ingests both)
        off = ["--blend-calibration", "off"]
        cli("--cache-server", server.target, "--cpu-cache", "0", *off, *files)
        blended = cli(
            "--cache-server", server.target, "--cpu-cache", "0", "--blend-ratio", "0.5", *files
        )[0]
        assert blended["external_tokens"] == 80
        assert blended["blend"] == {"loaded": 80, "recomputed": 40, "computed": 4, "full_layers": 1}
        system = tmp_path / "system.ids"
        system.write_text(
            ",".join(str(j * 11 % 500) for j in range(50))
        )  # chunks of 32: one whole, one partial
        cli(
            "--cache-server",
            server.target,
            "--cpu-cache",
            "0",
            *off,
            "--system",
            str(system),
            *files,
        )  # docs under it
        after = cli(
            "--cache-server",
            server.target,
            "--cpu-cache",
            "0",
            "--blend-ratio",
            "0.0",
            "--system",
            str(system),
            *files,
        )[0]
        assert (
            after["external_tokens"] == 50 + 80
        )  # the system prompt exactly, the documents stored after it
        assert after["blend"] == {"loaded": 80, "recomputed": 0, "computed": 4, "full_layers": 0}
    finally:
        server.stop(kill=True)
