"""``compile.cache_dir``: compiled artefacts kept between launches, in torch's own caches, one folder per key.

Inductor keeps what it generated (the FX graph cache, the AOT autograd cache, Triton's kernels) under
``TORCHINDUCTOR_CACHE_DIR``; its entries are keyed by the graph, the inputs' shapes and torch's build, so a warm
folder turns a launch's code generation into lookups. xfuse points that variable at ``<cache_dir>/<key>`` before a
rank compiles anything, ``<key>`` a digest of what makes compiled artefacts of another launch useless here (torch's
version, the model's family and config, the dtype, the device type, the backend and ``dynamic``), and keeps a
``xfuse-cache.json`` beside them naming the key's parts and the request shapes compiled into it, which
``xfuse doctor --compile-cache`` reports. Dynamo still traces each block at a launch's first request of a shape
(its bytecode analysis is not cached by torch); Inductor then generates nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

__all__ = ["CacheEntry", "CompileCache", "cache_key", "entries"]

META = "xfuse-cache.json"


@dataclass(frozen=True)
class CacheEntry:
    """One key's folder as ``xfuse-cache.json`` describes it."""

    key: str
    torch: str
    family: str
    model_config_hash: str
    dtype: str
    device: str
    backend: str
    dynamic: bool
    shapes: list[str] = field(default_factory=list)  # request shapes compiled into it, as the compile lines name them
    created: str = ""
    updated: str = ""


def cache_key(parts: dict[str, object]) -> str:
    """The folder name of ``parts`` (what ``CacheEntry`` records besides the shapes): 16 hex digits."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class CompileCache:
    """This launch's folder under ``cache_dir``: where Inductor writes, and the record of what it holds."""

    def __init__(self, cache_dir: str, *, torch: str, family: str, model_config_hash: str, dtype: str, device: str,
                 backend: str, dynamic: bool):  # fmt: skip
        parts = dict(torch=torch, family=family, model_config_hash=model_config_hash, dtype=dtype, device=device,
                     backend=backend, dynamic=dynamic)  # fmt: skip
        self.key = cache_key(parts)
        self.folder = os.path.join(os.path.abspath(cache_dir), self.key)
        self._parts = parts

    @property
    def warm(self) -> bool:
        """Whether an earlier launch left a record here."""
        return os.path.exists(os.path.join(self.folder, META))

    def activate(self) -> None:
        """Point Inductor's caches at this folder (before anything compiles in this process)."""
        os.makedirs(self.folder, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.folder  # read by Inductor at each cache access

    def record(self, shape: str) -> None:
        """Note ``shape`` in the folder's record (atomically: ranks of one node share the folder)."""
        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        entry = self.read() or CacheEntry(key=self.key, created=now, **self._parts)  # type: ignore[arg-type]
        shapes = entry.shapes if shape in entry.shapes else [*entry.shapes, shape]
        data = asdict(entry) | {"shapes": shapes, "updated": now}
        path = os.path.join(self.folder, META)
        temporary = f"{path}.{os.getpid()}"
        with open(temporary, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(temporary, path)

    def read(self) -> CacheEntry | None:
        return _read(self.folder)


def _read(folder: str) -> CacheEntry | None:
    try:
        with open(os.path.join(folder, META)) as fh:
            return CacheEntry(**json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def entries(cache_dir: str) -> list[tuple[CacheEntry, int]]:
    """Every recorded key under ``cache_dir`` with its folder's size in bytes, newest first."""
    found = []
    if os.path.isdir(cache_dir):
        for name in sorted(os.listdir(cache_dir)):
            folder = os.path.join(cache_dir, name)
            entry = _read(folder)
            if entry is not None:
                size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
                found.append((entry, size))
    return sorted(found, key=lambda pair: pair[0].updated, reverse=True)
