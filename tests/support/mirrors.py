"""The diffusers functions xfuse's code mirrors, and the signatures the mirrors were written against.

Where xfuse re-expresses diffusers code (a pipeline's ``__call__`` around PipeFusion's loop, a processor's
``__call__`` with stale K/V, a patch embedding for one band), the comment or docstring names it in one format:
the full importable path in double backticks, e.g. ``diffusers.FluxPipeline.__call__``. ``references()`` finds
every such name in the package; ``MIRRORED_SIGNATURES`` (``mirrored_signatures.json`` beside this file) holds each
one's ``inspect.signature`` as it was when the mirror was written. ``tests/unit/test_mirrors.py`` fails when the
installed diffusers changes one of them, so an upgrade says which mirrors to re-read instead of drifting silently.

Re-record after re-reading the mirrors against a new diffusers: ``python -m tests.support.mirrors --record``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path

from tests.support import REPO

PACKAGE = REPO / "xfuse"
RECORD = Path(__file__).with_name("mirrored_signatures.json")
REFERENCE = re.compile(r"``(diffusers(?:\.[A-Za-z_][A-Za-z0-9_]*)+)``")
# A claim to mirror diffusers: "mirrors", "mirroring", "Mirrors" (not "mirrored_processor", "mirror pair").
CLAIM = re.compile(r"\b[Mm]irror(?:s|ing)\b")
# Where the claims are about diffusers (the placement code's "mirror" blocks are another sense of the word).
CLAIM_FOLDERS = ("families", "pipelines")


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def references() -> dict[str, list[str]]:
    """Every ``diffusers.<path>`` named in xfuse's source -> the places (``file:line``) that name it."""
    found: dict[str, list[str]] = {}
    for path in source_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for name in REFERENCE.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{number}")
    return found


def unnamed_claims() -> list[str]:
    """Places in the family and pipeline code that claim to mirror something without naming a diffusers path soon
    after the claim (within the sentence that follows it)."""
    bad = []
    for folder in CLAIM_FOLDERS:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for claim in CLAIM.finditer(text):
                following = " ".join(text[claim.end() : claim.end() + 200].split())
                sentence = following.split(". ")[0]
                if "``diffusers." not in sentence:
                    line = text.count("\n", 0, claim.start()) + 1
                    bad.append(f"{path.relative_to(REPO)}:{line}: {text.splitlines()[line - 1].strip()}")
    return bad


def resolve(name: str):
    """The object a dotted ``diffusers....`` path names: the longest importable module, then attributes."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


def signature(name: str) -> str:
    """The parameters (names, kinds, defaults) of what ``name`` resolves to (a class: its constructor), as
    ``inspect.signature`` writes them. Without annotations: those name classes whose module depends on the
    environment (transformers picks an image processor by whether torchvision is installed), not on diffusers."""
    return parameters(resolve(name))


def parameters(function) -> str:
    """``function``'s parameters without annotations, e.g. ``(self, prompt=None, height=None)``."""
    sig = inspect.signature(function)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def load_record() -> dict[str, str]:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def record() -> dict[str, str]:
    """Write every referenced name's current signature to ``RECORD`` (after re-reading the mirrors)."""
    import diffusers

    signatures = {name: signature(name) for name in sorted(references())}
    RECORD.write_text(json.dumps(signatures, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"recorded {len(signatures)} signatures of diffusers {diffusers.__version__} in {RECORD}")
    return signatures


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.support.mirrors --record")
    record()
