"""The latency model replays the engine's own schedule: checked against the schedule and against physics."""

import pytest

from xfuse.config import ConfigError, XfuseConfig, config_from_dict
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.schedule import build_schedule
from xfuse.parallel.stage_plan import stage_plan
from xfuse.perf_model import A100, LINKS, LinkProfile, block_flops, l40_profile, predict, replay
from xfuse.plan_report import format_plan_report, plan_report, predicted_latency


@pytest.mark.parametrize(
    "degree,placement,patches,warmup,parts",
    [
        (2, "folded", 2, 1, 1),
        (3, "linear", 4, 0, 1),
        (4, "folded", 8, 2, 1),
        (2, "folded", 2, 1, 2),
        (3, "linear", 3, 5, 2),
    ],
)
def test_replay_with_unit_costs_reproduces_the_schedule_timeline(degree, placement, patches, warmup, parts):
    plan = stage_plan(16, degree, placement, skips=HUNYUANDIT.skip_pairs(16))
    schedule = build_schedule(plan, 5, warmup, patches, parts)

    def cost(t):  # one unit per block per patch; a whole-image task costs all patches, a batch part its share
        whole = patches if t.part is None else patches / parts
        return 0.0 if t.hop < 0 else len(schedule.plan.route[t.hop].blocks) * (whole if t.patch is None else 1)

    makespan = replay(schedule, cost, lambda m: 0.0)
    assert makespan == max(end for _, end in schedule.times.values())


def test_attention_grows_with_image_tokens_and_patches_sum_to_the_whole():
    whole = block_flops(4096, 4096)
    assert block_flops(1024, 4096) * 4 == pytest.approx(whole)  # 4 patches of 1024 queries = the whole image
    assert block_flops(4096, 16384) > block_flops(4096, 4096)


def test_a_slower_link_never_helps_and_hurts_linear_more_than_folded():
    slow = LinkProfile("slow", 2e9, 1e-4)
    for placement in ("folded", "linear"):
        fast_t = predict(A100, LINKS["a100-nvlink"], degree=2, placement=placement, size=1024)
        slow_t = predict(A100, slow, degree=2, placement=placement, size=1024)
        assert slow_t >= fast_t
    folded = predict(A100, slow, degree=2, placement="folded", size=1024)
    linear = predict(A100, slow, degree=2, placement="linear", size=1024)
    assert linear > folded  # 19 skips per patch queue on the only link at pp2


def test_more_gpus_are_faster_on_nvlink_and_l40_is_slower_than_a100():
    times = [predict(A100, LINKS["a100-nvlink"], degree=n, placement="folded", size=1024) for n in (1, 2, 4)]
    assert times[0] > times[1] > times[2]
    assert predict(l40_profile(A100), LINKS["l40-pcie"], degree=2, placement="folded", size=1024) > times[1]


@pytest.mark.parametrize("link", ["a100-nvlink", "l40-pcie"])
def test_balanced_is_never_slower_than_folded_and_faster_where_folded_is_uneven(link):
    """At 40 blocks folded's ranks are uneven at N = 3, 6, 7, 8 (e.g. 6/6/6/6/4/4/4/4 at N = 8), balanced's even to
    one block at the cost of a few skips crossing one rank; where N divides 20 the two plans are the same."""
    profile = A100 if link == "a100-nvlink" else l40_profile(A100)
    for degree in range(2, 9):
        folded, balanced = (
            predict(profile, LINKS[link], degree=degree, placement=p, size=1024) for p in ("folded", "balanced")
        )
        if degree in (2, 4, 5):
            assert balanced == folded
        else:
            assert balanced < folded, degree
    eight = [predict(profile, LINKS[link], degree=8, placement=p, size=1024) for p in ("folded", "balanced")]
    assert eight[1] < 0.96 * eight[0]  # 5 blocks on every rank instead of 6 on the busiest: ~1/6 of the loop


@pytest.mark.parametrize("link", ["a100-nvlink", "l40-pcie"])
def test_warmup_in_batch_parts_is_faster_from_two_gpus_on(link):
    """xfuse streams the warm-up step's [uncond, cond] halves through the route as two parts (xDiT runs it whole,
    the calibration's schedule): the same at one GPU, faster from two on, by at most the warm-up step's idle time."""
    profile = A100 if link == "a100-nvlink" else l40_profile(A100)
    for degree in range(1, 9):
        split, whole = (
            predict(profile, LINKS[link], degree=degree, placement="balanced", size=1024, warmup=2, split_warmup=s)
            for s in (True, False)
        )
        if degree == 1:
            assert split == whole
            step = (whole - profile.outside_loop[1024]) / 50  # one whole-image step on one GPU
        else:  # saving at most the two warm-up steps' time
            assert whole - 2 * step < split < whole, degree


def _plan_config(model, **parallel):
    generation = {"height": 1024, "width": 1024, "num_inference_steps": 50}
    return config_from_dict(
        {"model": model, "parallel": {"pipefusion_degree": 2, **parallel}, "generation": generation}
    )


@pytest.mark.parametrize("link", ["a100-nvlink", "l40-pcie"])
def test_the_plan_report_predicts_the_dit_g2_shape_on_each_link(link):
    """``xfuse plan --predict LINK``: plan_report's block count, width and plan reach perf_model.predict."""
    report = plan_report(_plan_config("dit-g2"))
    assert "world 2 = pipefusion 2 x cfg 1; placement balanced; 2 patches" in format_plan_report(report)
    profile = A100 if link == "a100-nvlink" else l40_profile(A100)
    seconds = predict(profile, LINKS[link], degree=2, placement="balanced", size=1024, steps=50, warmup=1)
    assert predicted_latency(report, link).startswith(
        f"predicted latency ({LINKS[link].name}): {seconds:.1f} s per image"
    )


@pytest.mark.parametrize(
    "model,parallel,link,says",
    [
        (
            "small",
            {},
            "a100-nvlink",
            "only for the HunyuanDiT-g/2 shape (40 blocks, hidden 1408) at square [1024, 2048] px",
        ),
        ("dit-g2", {"cfg_degree": 2}, "l40-pcie", "the model does not cover cfg_degree 2"),
    ],
)
def test_the_plan_report_says_what_it_cannot_predict(model, parallel, link, says):
    report = plan_report(_plan_config(model, **parallel))
    assert predicted_latency(report, link) == f"predicted latency ({link}): {says}"


def test_the_plan_report_refuses_an_unknown_link_by_its_option():
    with pytest.raises(ConfigError, match=r"--predict: must be one of a100-nvlink, l40-pcie \(got 'h100'\)"):
        predicted_latency(plan_report(_plan_config("dit-g2")), "h100")


def test_a_config_without_a_request_section_plans_the_default_request():
    """``XfuseConfig(generation=None)`` (Python only; YAML fills in the section) plans what the defaults ask for."""
    given = _plan_config("dit-g2")
    bare = XfuseConfig(model=given.model, parallel=given.parallel, generation=None)
    report, defaults = plan_report(bare), plan_report(XfuseConfig(model=given.model, parallel=given.parallel))
    assert report.generation == defaults.generation and report.generation.num_inference_steps == 20
    assert format_plan_report(report) == format_plan_report(defaults)
    assert predicted_latency(report, "a100-nvlink") == predicted_latency(defaults, "a100-nvlink")


def test_the_plan_report_shows_each_patchs_rows_and_work_share():
    """SD3-medium at 1024 px: 64 x 64 tokens, and the first patch carries the 77 + 256 text tokens, so cut by cost
    it gets 29 rows (1,856 + 333 = 2,189 tokens) and the second 35 (2,240); the schedule's ceiling beats the even
    cut's; HunyuanDiT carries no text: even rows, even shares."""
    from xfuse.parallel.costs import speedup_ceiling

    report = plan_report(_plan_config("sd3-medium"))
    text = format_plan_report(report)
    assert (
        "patches (token rows, share of the work): 0:[0,29) 49.4%  1:[29,64) 50.6%; patch 0 also carries the 333 "
        in text
    )
    assert f"schedule's ceiling: {report.ceiling:.2f}x the loop of one rank" in text
    steps = dict(num_steps=50, warmup_steps=1, batch_parts=2)
    assert report.ceiling > speedup_ceiling(report.plan, (32 * 64 + 333, 32 * 64), **steps)
    hunyuan = format_plan_report(plan_report(_plan_config("dit-g2")))
    assert "patches (token rows, share of the work): 0:[0,32) 50.0%  1:[32,64) 50.0%\n" in hunyuan
