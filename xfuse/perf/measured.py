"""What one block pass costs on a GPU, as measured: the pass curves of ``benchmarks/gpu_patch_cost.py``.

PipeFusion's premise is that a patch of 1/M of the image costs 1/M of a whole pass. On a GPU it does not: a small
pass uses the device less well (smaller matrix products and attention query tiles, kernel launches that no longer
hide behind the work). The GPU suite measures, per family at its released shape, the blocks' time of a whole-image
pass and of a step's M patch passes (M = 2, 4, 8, each over the stale K/V of the rest). Per family this module
keeps those points as a curve: (FLOPs of one block pass, seconds), where a point's FLOPs are the step's block FLOPs
(``ModelSpec.block_flops``, the model's own count) over its passes and blocks, and its seconds likewise.

The performance model (``xfuse.perf.model``) costs a measured family's block pass by its curve instead of a fitted
throughput, launch cost and traffic: the measured pass of the same ideal time (FLOPs over the device's peak: a pass
that fills a fraction of one device fills the same fraction of another), scaled by the device's fitted efficiency
on FLUX's blocks over the efficiency FLUX's whole pass reached in the measurement (``REFERENCE``). A family's
throughput relative to FLUX is then measured, not fitted; what stays fitted per device is the level of the
published runs' software against the measurement's.

``python -m xfuse.perf.measured benchmarks/results/gpu.json`` prints the curves of a report, to paste into
``CURVES``; a test checks that ``CURVES`` is the committed report's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from xfuse.perf.hardware import DEVICES, Device


@dataclass(frozen=True)
class PassCurve:
    """Seconds of one block pass by its FLOPs, measured on ``device`` (a key of ``xfuse.perf.hardware.DEVICES``)."""

    device: str
    points: tuple[tuple[float, float], ...]  # (FLOPs of one block pass, seconds), FLOPs ascending

    def seconds(self, flops: float) -> float:
        """A pass of ``flops`` on the measured device: straight between the points on log-log axes. Beyond the
        largest point (a larger image) the time grows with the FLOPs (the device is full); below the smallest it
        follows the smallest segment's slope, kept within [0, 1] (a smaller pass is never slower, nor faster than in
        proportion)."""
        points = self.points
        (f0, t0), (f1, t1) = points[0], points[1]
        if flops >= points[-1][0]:
            return points[-1][1] * flops / points[-1][0]
        if flops <= f0:
            slope = min(max(math.log(t1 / t0) / math.log(f1 / f0), 0.0), 1.0)
            return t0 * (flops / f0) ** slope
        for (fa, ta), (fb, tb) in zip(points, points[1:], strict=False):
            if flops <= fb:
                w = math.log(flops / fa) / math.log(fb / fa)
                return math.exp((1 - w) * math.log(ta) + w * math.log(tb))
        raise AssertionError("unreachable: flops is below the largest point")

    @property
    def efficiency(self) -> float:
        """The fraction of the measured device's peak its largest pass (the whole image) reached."""
        flops, seconds = self.points[-1]
        return flops / seconds / DEVICES[self.device].peak_flops

    def seconds_on(self, flops: float, device: Device, relative: float) -> float:
        """A pass of ``flops`` on ``device``, whose efficiency is ``relative`` times what the measurement reached:
        the measured pass of the same ideal time (FLOPs over peak), over ``relative``."""
        measured = DEVICES[self.device]
        return self.seconds(flops * measured.peak_flops / device.peak_flops) / relative


# The reference family: the devices' fitted efficiencies are its whole blocks' (the measured curves are carried to a
# device through its measured whole-pass efficiency), and the other families' throughputs are relative to it.
REFERENCE = "flux"


def even_rows(rows: int, patches: int) -> list[int]:
    """Token rows of each of ``patches`` bands of ``rows``, as even as they go (the first bands take the remainder):
    the cut the GPU suite measures."""
    base, extra = divmod(rows, patches)
    return [base + (i < extra) for i in range(patches)]


def device_key(machine: str) -> str:
    """The ``DEVICES`` key of a report's machine line (``"NVIDIA H100 80GB HBM3, x86_64, ..."`` -> ``"h100"``)."""
    words = re.split(r"[^a-z0-9]+", machine.split(",")[0].lower())  # "nvidia a100-sxm4-80gb" -> [..., "a100", ...]
    keys = [key for key in DEVICES if key in words]
    if len(keys) != 1:
        raise ValueError(f"no single known device in {machine!r} (known: {sorted(DEVICES)})")
    return keys[0]


# Rows a report measured before xfuse had the family's preset, at exactly that preset's config: the report's
# ``model`` -> the preset (FLUX.2 [dev]: diffusers' defaults, which the flux2-dev preset is).
MEASURED_AHEAD = {"black-forest-labs/FLUX.2-dev": "flux2-dev"}


def curves_from_report(report: dict) -> dict[str, PassCurve]:
    """The pass curves of a GPU suite report (``gpu.json``), per family spec name; families without an xfuse preset
    (measured ahead of their family folder and not in ``MEASURED_AHEAD``) or with an error are left out."""
    from xfuse.families.registry import model_spec, transformer_config

    device = device_key(report["machine"])
    section = report["patch_cost"]
    curves = {}
    for row in section["families"].values():
        preset = row.get("preset") or MEASURED_AHEAD.get(row["model"])
        if "error" in row or preset is None:
            continue
        spec = model_spec(preset)
        deep = row["depths"][1]
        config = {**transformer_config(preset), **dict.fromkeys(row["depth_keys"], deep)}
        blocks = spec.num_blocks(config)
        tokens, text = row["tokens"], row["text_tokens"]
        text_everywhere = row.get("text_in_later_patches", True) or not row["joint_text"]
        points = []
        for patches in (1, *section["patches"]):
            flops = 0.0
            for i, rows in enumerate(even_rows(row["token_rows"], patches)):
                queries = rows * row["tokens_per_row"]
                with_text = i == 0 or text_everywhere  # the step's first patch computes an MMDiT's text stream
                flops += sum(spec.block_flops(config, b, queries, tokens, text, with_text) for b in range(blocks))
            seconds = row["times"][str(deep)][str(patches)]["median_ms"] / 1e3
            passes = patches * blocks
            points.append((row["batch"] * flops / passes, seconds / passes))
        curves[spec.name] = PassCurve(device, tuple(sorted(points)))
    return curves


# Result of ``curves_from_report`` on benchmarks/results/gpu.json (python -m xfuse.perf.measured ...): one H100 80GB
# HBM3, torch 2.11 + CUDA 13.0, bf16, eager, 2026-11-26.
CURVES: dict[str, PassCurve] = {
    "hunyuandit": PassCurve(
        "h100", ((9.1216e10, 0.0017274), (1.7858e11, 0.0022009), (3.5332e11, 0.0020662), (7.0278e11, 0.0038961))
    ),
    "sd3": PassCurve(
        "h100", ((2.0282e11, 0.0011571), (4.055e11, 0.0016996), (8.1086e11, 0.0025838), (1.6216e12, 0.0049342))
    ),
    "flux": PassCurve(
        "h100", ((1.6317e11, 0.0010621), (3.2625e11, 0.0011686), (6.5241e11, 0.0016669), (1.3047e12, 0.0031556))
    ),
    "flux2": PassCurve(
        "h100", ((6.3055e11, 0.0013432), (1.2611e12, 0.0025258), (2.5222e12, 0.0051911), (5.0444e12, 0.0097553))
    ),
    "wan": PassCurve(
        "h100", ((1.0583e13, 0.021628), (2.1059e13, 0.04233), (4.2011e13, 0.083062), (8.3914e13, 0.16596))
    ),
}


def main(argv=None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the pass curves of a GPU suite report, to paste into CURVES")
    parser.add_argument("report", help="a gpu.json of benchmarks/gpu_suite.py with its patch_cost section")
    args = parser.parse_args(argv)
    with open(args.report) as fh:
        curves = curves_from_report(json.load(fh))
    print("CURVES: dict[str, PassCurve] = {")
    for name, curve in curves.items():
        points = ", ".join(f"({f:.5g}, {s:.5g})" for f, s in curve.points)
        print(f'    "{name}": PassCurve("{curve.device}", ({points})),')
    print("}")


if __name__ == "__main__":
    main()
