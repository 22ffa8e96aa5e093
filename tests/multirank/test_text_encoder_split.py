"""A text encoder split by layers over three gloo ranks (``xfuse.parallel.text_encoder_split``) against the same
encoder whole, for each architecture the split is for: FLUX.2 [dev]'s Mistral 3, [klein]'s (and Z-Image's) Qwen3 and
Qwen-Image's Qwen2.5-VL (its decoder takes ``inputs_embeds``; its rotary positions are three-axis). A padded batch
(the mask crosses to every rank) with every hidden state, then a call without them: the logits (the head on the
returned final output), every hidden state and the final output equal the whole encoder's exactly. Pipelines use it
in ``tests/multirank/test_flux2.py``."""

import pytest

from tests.support.text_split_fns import split_against_whole
from tests.support.world import World


@pytest.fixture(scope="module")
def world3():
    with World(3, start_timeout=240) as w:
        yield w


@pytest.mark.parametrize("kind,layers", [("mistral3", 30), ("qwen3", 27), ("qwen2.5-vl", 6)])
def test_split_equals_the_whole_encoder(world3, kind, layers):
    results = world3.run_ok(split_against_whole, kind, timeout=300)
    assert results[1:] == [None, None]
    diffs = results[0]
    assert len(diffs["hidden_states"]) == layers + 1  # the embeddings, then every layer's output
    assert diffs["logits"] == [0.0, 0.0] and set(diffs["hidden_states"]) == {0.0}
    assert diffs["no_hidden_states"]
