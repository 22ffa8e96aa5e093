"""Test helpers for xfuse (multi-rank worlds on CPU)."""

from .world import RankDied, RankResult, RemoteError, World, WorldError, WorldTimeout, run_world

__all__ = ["RankDied", "RankResult", "RemoteError", "World", "WorldError", "WorldTimeout", "run_world"]
