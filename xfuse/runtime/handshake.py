"""The start-up handshake: before any data moves, every rank publishes a fingerprint (versions, resolved config,
model config hash, stage plan) and all compare; any difference raises the same ``StartupMismatch`` on every rank,
listing each differing field and which ranks hold which value."""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from xfuse.errors import StartupMismatch


def flatten(prefix: str, value) -> dict[str, str]:
    """{"parallel": {"num_patches": 4}} -> {"parallel.num_patches": "4"}."""
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return {prefix: repr(value)}


def config_hash(config: dict) -> str:
    """Hash of a model config, without the keys that name where it was loaded from."""
    clean = {k: v for k, v in sorted(config.items()) if not k.startswith("_")}
    return hashlib.sha1(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()[:12]


def versions() -> dict[str, str]:
    import diffusers
    import torch

    from xfuse._version import __version__

    return {
        "version.xfuse": __version__,
        "version.torch": torch.__version__,
        "version.diffusers": diffusers.__version__,
    }


def handshake(fingerprint: dict[str, str], *, world_size: int, group=None) -> None:
    """Compare ``fingerprint`` across all ranks; raise ``StartupMismatch`` on every rank if any field differs."""
    if world_size == 1:
        return
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, fingerprint, group=group)
    lines = []
    for key in sorted(set().union(*everyone)):
        holders: dict[str, list[int]] = {}
        for rank, fp in enumerate(everyone):
            holders.setdefault(fp.get(key, "<missing>"), []).append(rank)
        if len(holders) > 1:
            lines.append(
                f"  {key}: "
                + "; ".join(
                    f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} = {v}" for v, r in holders.items()
                )
            )
    if lines:
        raise StartupMismatch(
            "ranks disagree at start-up (every rank must run the same xfuse, torch and "
            "diffusers, config and model):\n" + "\n".join(lines)
        )
