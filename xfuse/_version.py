"""The package's version: its one home (``pyproject.toml`` reads it; the start-up handshake compares it)."""

__version__ = "0.1.0"
