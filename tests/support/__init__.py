"""What the tests share: the multi-rank test world, rank functions (``*_fns.py``, pickled by reference), child
processes, the independent PipeFusion oracle, report parsers and the network-namespace hosts."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (the tests run commands from it)
