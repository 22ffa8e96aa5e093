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


def test_the_first_pipelined_step_is_always_computed():
    """Where passes turn from the whole image to patches (under SP a rank's tokens change there too)."""
    c = StepCache(cache_config({"method": "first_block", "threshold": 10.0}), num_tokens=6, first_pipelined=2)
    r = torch.ones(1, 6, 4)
    decided = []
    for step in range(5):
        decided.append(c.decide(step, r, slice(0, 6)))
        if decided[-1]:
            c.keep_head(r, slice(0, 6))
    assert decided == [True, False, True, False, False]  # step 0: nothing to compare with


def test_an_sp_group_decides_on_the_sums_of_its_chunks():
    """Each rank holds a chunk: the group's sums decide, so both ranks decide on the whole patch's change (here 10 %
    over the patch, while one chunk alone changed 20 % and the other 0 %)."""
    head = torch.ones(1, 6, 4)
    chunks = {0: (slice(0, 3), 1.2), 1: (slice(3, 6), 1.0)}
    changes = {rank: (head[:, tokens] * factor - head[:, tokens]).abs().sum() for rank, (tokens, factor) in
               chunks.items()}  # fmt: skip
    decided = []
    for tokens, factor in chunks.values():
        c = cache(threshold=0.15)
        c.keep_head(head, slice(0, 6))

        def group_sum(sums):
            assert sums[1].item() == 12.0  # this chunk's sum of |r_prev|
            return torch.stack((changes[0] + changes[1], torch.tensor(24.0)))

        decided.append(c.decide(1, head[:, tokens] * factor, tokens, group_sum))
    assert decided == [False, False]  # 10 % <= 15 %, though rank 0's own chunk changed 20 %


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


def test_taylor_does_not_extrapolate_across_the_first_pipelined_step():
    """Residuals written by whole-image passes (step 0) and by patch passes (step 2, the first pipelined): the newer
    one is added as it is; from the next computed step on, the two patch-pass steps extrapolate again."""
    c = StepCache(cache_config({"method": "taylor"}), num_tokens=6, first_pipelined=2)
    for step, value in ((0, 1.0), (2, 3.0)):
        c.store(0, step, slice(0, 6), torch.full((1, 6, 2), value), {})
    assert c.residual(0, 3, slice(0, 6))[0].unique().item() == 3.0
    c.store(0, 4, slice(0, 6), torch.full((1, 6, 2), 4.0), {})
    assert c.residual(0, 5, slice(0, 6))[0].unique().item() == 4.5  # r_4 + (r_4 - r_2) * (5 - 4) / (4 - 2)


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


def test_caching_composes_with_sequence_parallelism():
    config = config_from_dict({"cache": {"method": "first_block"}, "parallel": {"ulysses_degree": 2, "ring_degree": 2}})
    assert config.cache.enabled and config.parallel.sequence_degree == 4


@pytest.mark.parametrize(
    "cache_section,parallel,always,most,refill",
    [
        ({}, {"warmup_steps": 1}, "0-1", 6, (2, "0.5")),  # step 0, and step 1 (the first pipelined)
        ({"warmup_steps": 3}, {"warmup_steps": 1}, "0-2", 5, (2, "0.5")),
        ({}, {"warmup_steps": 3}, "0, 3", 6, (2, "0.5")),
        ({"max_skips": 2}, {"warmup_steps": 3}, "0, 3", 5, (2, "0.5")),  # S S | C | S S C S
        ({}, {"warmup_steps": 1, "num_patches": 1}, "0", 7, None),  # one patch: no pass turns to patches
        ({}, {"warmup_steps": 8}, "0", 7, None),  # exact mode: whole-image steps, no pipeline to drain
        ({}, {"warmup_steps": 1, "num_patches": 4}, "0-1", 6, (4, "0.25")),
    ],
)
def test_the_plan_line_counts_the_steps_always_computed(cache_section, parallel, always, most, refill):
    """The plan's step-cache line: the steps always computed, the most that can be skipped, and on a pipelined layout
    what a run of skipped steps costs, (N - 1) / M of a pipelined step (design §11)."""
    from xfuse.plan_report import format_plan_report, plan_report

    config = config_from_dict({
        "model": "tiny",
        "parallel": {"pipefusion_degree": 2, **parallel},
        "generation": {"num_inference_steps": 8},
        "cache": {"method": "first_block", **cache_section},
    })  # fmt: skip
    (line,) = [x for x in format_plan_report(plan_report(config)).splitlines() if x.startswith("step cache:")]
    assert f"steps {always} always computed, at most {most} of 8 skipped" in line
    if refill is None:
        assert "drains" not in line, line
    else:
        patches, fraction = refill
        assert line.endswith(
            f"; pipelined over 2 stages and {patches} patches, a run of skipped steps drains and refills the "
            f"pipeline: it saves its steps less {fraction} of a pipelined step"
        ), line


def test_a_half_precision_decision_does_not_overflow():
    """A patch's sums in float16 would pass 65504 (inf / inf: never computed again); they are taken in float32."""
    c = cache(threshold=0.1)
    c.num_tokens = 4096
    r = torch.ones(2, 4096, 64, dtype=torch.float16)  # 524,288 elements
    c.keep_head(r, slice(0, 4096))
    assert c.decide(1, r * 1.05, slice(0, 4096)) is False and c.decide(2, r * 1.5, slice(0, 4096)) is True
