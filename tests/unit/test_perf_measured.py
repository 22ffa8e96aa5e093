"""xfuse.perf.measured: the pass curves are the committed GPU report's, they pass through what was measured and
extend it by the stated rules, and the performance model costs a measured family by them on GPUs only."""

import json
import os

import pytest

from xfuse.perf.calibration import FITTED
from xfuse.perf.hardware import DEVICES, Device
from xfuse.perf.measured import CURVES, PassCurve, curves_from_report, device_key, even_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_curves_are_the_committed_reports():
    """CURVES is what ``python -m xfuse.perf.measured benchmarks/results/gpu.json`` prints (5 significant digits):
    a new GPU run without new curves, or curves edited by hand, fails here."""
    with open(os.path.join(REPO, "benchmarks", "results", "gpu.json")) as fh:
        report = json.load(fh)
    derived = curves_from_report(report)
    # Qwen-Image: no family yet; FLUX.2 measured before its folder existed, at its preset's config (MEASURED_AHEAD)
    assert set(derived) == set(CURVES) == {"hunyuandit", "sd3", "flux", "wan", "flux2"}
    for name, curve in derived.items():
        assert curve.device == CURVES[name].device == "h100"
        assert len(curve.points) == len(CURVES[name].points) == 4  # the whole image and M = 2, 4, 8
        for (f, s), (f_kept, s_kept) in zip(curve.points, CURVES[name].points, strict=True):
            assert f_kept == pytest.approx(f, rel=1e-4) and s_kept == pytest.approx(s, rel=1e-4)
    # the whole pass of FLUX.1-dev's blocks reached about 42 % of the H100's dense bf16 peak
    assert CURVES["flux"].efficiency == pytest.approx(1.3047e12 / 0.0031556 / 989e12)


def test_a_point_is_the_steps_flops_and_time_over_its_passes_and_blocks():
    """One family by hand: FLUX.1's M = 2 point from the report's times and the spec's block FLOPs (the first patch
    computes the text stream, the second does not)."""
    from xfuse.families.registry import model_spec, transformer_config

    with open(os.path.join(REPO, "benchmarks", "results", "gpu.json")) as fh:
        row = json.load(fh)["patch_cost"]["families"]["FLUX.1"]
    spec = model_spec("flux-dev")
    config = {**transformer_config("flux-dev"), "num_layers": 4, "num_single_layers": 4}
    tokens = 64 * 64
    passes = [(b, first) for b in range(8) for first in (True, False)]  # 8 blocks, 2 patches
    flops = sum(spec.block_flops(config, b, tokens // 2, tokens, 512, first) for b, first in passes)
    seconds = row["times"]["4"]["2"]["median_ms"] / 1e3
    assert (flops / 16, seconds / 16) in curves_from_report({"machine": "NVIDIA H100 80GB HBM3, x86_64", "patch_cost": {
        "patches": [2], "families": {"FLUX.1": row}}})["flux"].points  # fmt: skip


CURVE = PassCurve("h100", ((1e9, 1e-3), (4e9, 2e-3), (16e9, 8e-3)))


@pytest.mark.parametrize(
    "flops,seconds",
    [
        (1e9, 1e-3),  # the points themselves
        (4e9, 2e-3),
        (16e9, 8e-3),
        (2e9, 2**0.5 * 1e-3),  # halfway on log-log axes between the first two
        (8e9, 4e-3),  # halfway between the last two (slope 1)
        (64e9, 32e-3),  # beyond the largest: in proportion
        (0.25e9, 0.5e-3),  # below the smallest: the first segment's slope (1/2)
    ],
)
def test_a_curve_interpolates_on_log_log_axes_and_extends_by_its_rules(flops, seconds):
    assert CURVE.seconds(flops) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    "points,below",
    [
        (((1e9, 1e-3), (2e9, 4e-3), (4e9, 8e-3)), 0.5e-3),  # a slope of 2 is kept at 1: never faster than in
        # proportion
        (((1e9, 2e-3), (2e9, 1e-3), (4e9, 3e-3)), 2e-3),  # a falling first segment is kept at 0: never slower
    ],
)
def test_below_the_smallest_point_the_slope_is_kept_within_0_and_1(points, below):
    assert PassCurve("h100", points).seconds(0.5e9) == pytest.approx(below, rel=1e-12)


def test_on_another_device_a_pass_costs_the_measured_pass_of_the_same_ideal_time():
    half = Device("half an H100", DEVICES["h100"].peak_flops / 2, 1e12)
    assert CURVE.seconds_on(2e9, DEVICES["h100"], 1.0) == CURVE.seconds(2e9)
    assert CURVE.seconds_on(2e9, half, 1.0) == pytest.approx(CURVE.seconds(4e9))
    assert CURVE.seconds_on(2e9, half, 0.5) == pytest.approx(2 * CURVE.seconds(4e9))


def test_the_model_uses_a_curve_on_gpus_for_measured_families_only():
    assert FITTED.curve("flux", DEVICES["a100"]) is CURVES["flux"]
    assert FITTED.curve("flux", DEVICES["cpu"]) is None  # the CPU keeps its fitted throughput
    assert FITTED.curve("pixart", DEVICES["h100"]) is None  # not measured: the fitted throughput prices it
    # a device's level is its fitted efficiency on FLUX's blocks over what FLUX's whole pass reached when measured
    assert FITTED.relative("h100") == pytest.approx(FITTED.efficiency["h100"] / CURVES["flux"].efficiency)


def test_report_machines_name_their_device_and_an_unknown_one_is_refused():
    assert device_key("NVIDIA H100 80GB HBM3, x86_64, 16 cores, torch 2.11.0+cu130") == "h100"
    assert device_key("NVIDIA A100-SXM4-80GB, x86_64") == "a100"
    with pytest.raises(ValueError, match=r"no single known device in 'no GPU, x86_64' \(known: \['a100', "):
        device_key("no GPU, x86_64")


def test_even_rows_cut_as_even_as_they_go():
    assert even_rows(64, 8) == [8] * 8
    assert even_rows(30, 4) == [8, 8, 7, 7]
    assert sum(even_rows(30, 8)) == 30
