"""``xfuse.runtime.heap.collector_paused``: the garbage collector off while a family's modules are imported, and as it
was after (on or off, an exception or not)."""

import gc
import importlib

import pytest

from xfuse.families import spec as spec_module
from xfuse.families.registry import HUNYUANDIT
from xfuse.runtime.heap import collector_paused


@pytest.fixture
def collector_restored():
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_inside_and_as_it_was_after(collector_restored, enabled):
    gc.enable() if enabled else gc.disable()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner block leaves it paused for the outer one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() is enabled
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("inside")
    assert gc.isenabled() is enabled


def test_a_familys_modules_are_imported_with_the_collector_paused(collector_restored, monkeypatch):
    gc.enable()
    seen = []
    import_module = importlib.import_module

    def recording_import(name, package=None):
        seen.append((name, gc.isenabled()))
        return import_module(name, package)

    monkeypatch.setattr(spec_module.importlib, "import_module", recording_import)
    assert HUNYUANDIT.pipeline_class().__name__ == "PipeFusionHunyuanDiTPipeline"
    # the family's module first, then whatever it imports lazily (diffusers' and transformers' modules): all paused
    assert seen[0] == ("xfuse.families.hunyuandit.pipeline", False)
    assert [name for name, enabled in seen if enabled] == []
    assert gc.isenabled()
