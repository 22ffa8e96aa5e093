"""``xfuse.parallel.step_cache``'s state, pure: the decision rule (diffusers' relative mean absolute change), the
residuals a skipped segment adds (``taylor``: first-order extrapolation), and the named divergence check."""

import pytest
import torch

from xfuse.config import ConfigError, cache_config, config_from_dict
from xfuse.parallel.step_cache import StepCache, check_decisions


def cache(**settings):
    return StepCache(cache_config({"method": "first_block", **settings}), num_tokens=6)


def test_the_decision_is_diffusers_relative_change_of_block_0s_residual():
    c = cache(threshold=0.1)
    first = torch.ones(1, 6, 4)
    assert c.decide(0, first, slice(0, 6)) is True  # nothing to compare with: computed
    c.keep_head(first, slice(0, 6))
    assert c.decide(1, first * 1.05, slice(0, 6)) is False  # 5 % change <= 10 %: skipped
    assert c.decide(2, first * 1.2, slice(0, 6)) is True  # 20 % against the last *computed* step's residual
    c.keep_head(first * 1.2, slice(0, 6))
    # Over the first task's tokens only (patch 0's), against the same tokens at the last computed step.
    c.head[:, 3:] = 100.0
    assert c.decide(3, first[:, :3] * 1.2, slice(0, 3)) is False
    assert c.decisions == {0: True, 1: False, 2: True, 3: False}


def test_warmup_and_max_skips_force_computed_steps():
    c = cache(threshold=10.0, warmup_steps=2, max_skips=2)
    r = torch.ones(1, 6, 4)
    c.keep_head(r, slice(0, 6))
    decided = [c.decide(step, r, slice(0, 6)) for step in range(8)]
    assert decided == [True, True, False, False, True, False, False, True]


@pytest.mark.parametrize("method", ["first_block", "taylor"])
def test_a_skipped_segment_adds_the_last_residual_or_its_first_order_prediction(method):
    c = cache(method=method)
    for step, value in ((2, 1.0), (4, 3.0)):  # computed steps 2 and 4, written patch by patch
        c.store(0, step, slice(0, 3), torch.full((1, 3, 2), value), {"text": torch.full((1, 5, 2), 10 * value)})
        c.store(0, step, slice(3, 6), torch.full((1, 3, 2), value + 0.5), {})
    residual, streams = c.residual(0, 5, slice(2, 5))
    if method == "first_block":  # the last computed step's, as it was
        assert residual[0, :, 0].tolist() == [3.0, 3.5, 3.5] and streams["text"].unique().item() == 30.0
    else:  # r_4 + (r_4 - r_2) * (5 - 4) / (4 - 2)
        assert residual[0, :, 0].tolist() == [4.0, 4.5, 4.5] and streams["text"].unique().item() == 40.0


def test_divergent_decisions_are_named():
    check_decisions([(0, [True, False]), (0, [True, False]), (1, [True, True]), (1, [True, True])])  # CFG groups
    with pytest.raises(RuntimeError) as e:
        check_decisions([(0, [True, False, True]), (0, [True, True, True])])
    assert str(e.value).startswith(
        "step cache: the ranks of pipeline group 0 took different decisions at step 1: rank 0 skipped it, rank 1 "
        "computed it"
    )


@pytest.mark.parametrize(
    "section,key,says",
    [
        ({"method": "fbc"}, "cache.method", "'off', 'first_block', 'taylor'"),
        ({"threshold": -0.1}, "cache.threshold", ">= 0.0"),
        ({"warmup_steps": -1}, "cache.warmup_steps", ">= 0"),
        ({"max_skips": 0}, "cache.max_skips", ">= 1"),
        ({"threshld": 0.1}, "cache.threshld", "did you mean 'cache.threshold'"),
    ],
)
def test_bad_cache_settings_name_the_key(section, key, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"cache": section})
    assert e.value.key == key and says in str(e.value)


def test_caching_inside_a_sequence_parallel_stage_is_refused():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"cache": {"method": "first_block"}, "parallel": {"ulysses_degree": 2}})
    assert e.value.key == "cache.method" and "not yet inside a sequence-parallel stage" in str(e.value)
    assert config_from_dict({"cache": {"method": "off"}, "parallel": {"ulysses_degree": 2}}).cache.enabled is False
