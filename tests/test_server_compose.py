"""docker-compose.yml and the Dockerfile: parsed and checked (no Docker engine runs here)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import tomllib
import yaml

from tierkv.cacheserver import config as cfg

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_ports_health_volume() -> None:
    doc = compose()
    services = doc["services"]
    assert {"redis", "tierkv-server"} <= set(services)
    redis, server = services["redis"], services["tierkv-server"]
    assert redis["image"].startswith("redis:7")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert (
        server["build"] == "." and server["depends_on"]["redis"]["condition"] == "service_healthy"
    )
    env = {k: str(v) for k, v in server["environment"].items()}
    port = env["TIERKV_PORT"]
    # Published on loopback only; container ports match the server's and the metrics port.
    assert f"127.0.0.1:{port}:{port}" in server["ports"]
    assert f"127.0.0.1:{env['TIERKV_METRICS_PORT']}:{env['TIERKV_METRICS_PORT']}" in server["ports"]
    assert all(p.startswith("127.0.0.1:") for p in redis["ports"] + server["ports"])
    assert server["healthcheck"]["test"] == [
        "CMD",
        "tierkv-server",
        "health",
        "--target",
        f"127.0.0.1:{port}",
    ]
    vol, mount = server["volumes"][0].split(":")
    assert vol in doc["volumes"] and mount == env["TIERKV_CACHE_DIR"]
    assert env["TIERKV_REDIS_URL"] == "redis://redis:6379/0"
    # The environment is a valid server config (compose leaves ${TIERKV_TOKENS:-} empty by default).
    env["TIERKV_TOKENS"] = ""
    c = cfg.load(None, env)
    assert (c.host, c.port, c.cache_dir, c.metrics_port) == ("0.0.0.0", int(port), mount, 9400)
    assert c.tiers.cpu_bytes == 4 << 30 and c.tiers.redis_url and not c.auth
    grace = int(re.match(r"(\d+)s", server["stop_grace_period"]).group(1))
    assert grace > c.grace_s  # SIGTERM drains before Docker's SIGKILL


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.1\d", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text  # never a CUDA torch in the server image
    assert (
        'ENTRYPOINT ["tierkv-server"]' in text
        and "HEALTHCHECK" in text
        and "VOLUME /var/cache/tierkv" in text
    )
    # `pip install .` needs every part's folder: the whole context goes in, and .dockerignore
    # leaves out only what the wheel does not hold.
    assert re.search(r"^COPY \. \.$", text, re.M)
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for d in (*dirs.values(), "pyproject.toml", "README.md"):
        assert not any(fnmatch.fnmatch(d, pat) for pat in ignored), d
    for d in ("tests", "bench", ".venv", ".git"):
        assert any(fnmatch.fnmatch(d, pat) for pat in ignored), d
    assert "USER tierkv" in text


def test_docker_compose_config_where_available() -> None:
    """`docker compose config` validates the file where the compose plugin is installed."""
    docker = shutil.which("docker")
    has_compose = (
        docker is not None
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    )
    if has_compose:
        out = subprocess.run(
            [docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
    else:  # no plugin here: the YAML must still load as a compose document
        assert compose()["services"]
