"""The model's constants, fitted to published points, and its error on the points it did not see.

``python -m xfuse.perf.calibration`` prints the predicted-vs-published table (docs/performance.md has it);
``--fit`` refits (a few minutes: hundreds of schedule replays) and prints the constants to paste into ``FITTED``.

The fit: least squares on log(predicted / published) over the points ``published.Point.held_out`` leaves in
(single- and 2-GPU figures), by Nelder-Mead on the logarithms of the constants the points can tell apart
(``free_constants``): a device's efficiency (per device), the per-block overhead of a task and the time outside the
loop per megapixel (shared); a family's throughput relative to FLUX and the elementwise memory traffic only for
families without a measured pass curve (``xfuse.perf.measured``; every family with published points has one).
Then, with those, this machine's CPU: its efficiency (from the single rank) and gloo's cost per message between two
busy ranks (from Ulysses 2).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from xfuse.config import ParallelConfig, parallel_config
from xfuse.families.registry import model_spec, transformer_config
from xfuse.perf.measured import CURVES, REFERENCE
from xfuse.perf.model import Calibration, Machine, Prediction, Workload, predict
from xfuse.perf.model import machine as machine_of
from xfuse.perf.published import CPU_POINTS, POINTS, Point

# Result of ``fit()`` (python -m xfuse.perf.calibration --fit), kept so that predictions are instant. The families
# with published points (HunyuanDiT, SD3, FLUX) are costed by their measured pass curves (``CURVES``), so no family
# factor is fitted; ``traffic`` is the fit's from before the curves (2026-11-25) and prices the families without one
# (PixArt-Σ) and the CPU, which no point can tell apart now.
FITTED = Calibration(
    efficiency={"a100": 0.6031, "h100": 0.4013, "l40": 0.6628, "cpu": 0.8820},
    family={},
    traffic=144.95,
    launch=0.0005881,
    outside=0.1472,
    latency={"cpu-gloo": 0.002826},
    curves=CURVES,
)


def workload(point: Point) -> Workload:
    spec = model_spec(point.model)
    cfg_batch = 1 if spec.distilled_guidance else 2  # the published runs use guidance (FLUX: distilled)
    return Workload(spec, transformer_config(point.model), point.size, point.size, point.steps, cfg_batch)


def machine(point: Point) -> Machine:
    return machine_of(point.device, point.link, point.gpus, point.nodes)


def layout(point: Point) -> ParallelConfig:
    """The layout the point ran: xDiT's defaults (linear placement, M = pipefusion degree, one warm-up step); the
    CPU points are xfuse's (the family's default placement, the same M and warm-up)."""
    placement = None if point.device == "cpu" else "linear"
    degrees = {"pipefusion_degree": point.pipefusion, "cfg_degree": point.cfg}
    return parallel_config(
        {**degrees, "ulysses_degree": point.ulysses, "ring_degree": point.ring, "placement": placement}
    )


def predict_point(point: Point, calibration: Calibration = FITTED) -> Prediction:
    return predict(workload(point), layout(point), machine(point), calibration, split_warmup=point.device == "cpu")


def seconds(point: Point, calibration: Calibration = FITTED) -> float:
    p = predict_point(point, calibration)
    return p.seconds if point.decoded else p.loop


def free_constants(points, calibration: Calibration) -> tuple[list[str], list[str], list[str]]:
    """The constants the points can tell apart: (devices, families, shared). A family with a measured pass curve
    (``xfuse.perf.measured``) is costed by it: its throughput relative to FLUX is measured, and the traffic and the
    launch cost are free only where a point's family has no curve. FLUX is the families' reference."""
    names = {p: model_spec(p.model).name for p in points}
    unmeasured = [p for p in points if names[p] not in calibration.curves]
    devices = sorted({p.device for p in points})
    families = sorted({names[p] for p in unmeasured} - {REFERENCE})
    shared = (["traffic"] if unmeasured else []) + ["launch", "outside"]
    return devices, families, shared


def _pack(c: Calibration, devices, families, shared) -> list[float]:
    return (
        [math.log(c.efficiency[d]) for d in devices]
        + [math.log(c.family[f]) for f in families]
        + [math.log(getattr(c, k)) for k in shared]
    )


def _unpack(x: list[float], base: Calibration, devices, families, shared) -> Calibration:
    values = [math.exp(v) for v in x]
    nd, nf = len(devices), len(families)
    return replace(
        base,
        efficiency={**base.efficiency, **dict(zip(devices, values[:nd], strict=True))},
        family={**base.family, **dict(zip(families, values[nd : nd + nf], strict=True))},
        **dict(zip(shared, values[nd + nf :], strict=True)),
    )


def _loss(points, calibration: Calibration) -> float:
    return sum(math.log(seconds(p, calibration) / p.seconds) ** 2 for p in points)


def _toward(centroid: list[float], worst: list[float], t: float) -> list[float]:
    """The point ``t`` of the way from the simplex's centroid to its worst vertex (negative: beyond the centroid)."""
    return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]


def nelder_mead(f, x0: list[float], step: float = 0.3, iterations: int = 400, tolerance: float = 1e-7) -> list[float]:
    """Minimise ``f`` from ``x0`` (the textbook simplex method: reflect, expand, contract, shrink)."""
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = [sum(col) / (len(simplex) - 1) for col in zip(*simplex[:-1], strict=True)]
        reflected = _toward(centroid, simplex[-1], -1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = _toward(centroid, simplex[-1], -2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = _toward(centroid, simplex[-1], 0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x, strict=True)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit(start: Calibration = FITTED) -> Calibration:
    """Fit the GPU constants to the published points the fit may see, then the CPU's efficiency to its single rank."""
    train = [p for p in POINTS if not p.held_out]
    free = free_constants(train, start)
    result = _unpack(nelder_mead(lambda x: _loss(train, _unpack(x, start, *free)), _pack(start, *free)), start, *free)
    cpu = [p for p in CPU_POINTS if not p.held_out]

    def with_cpu(x: list[float]) -> Calibration:
        efficiency, latency = math.exp(x[0]), math.exp(x[1])
        return replace(
            result,
            efficiency={**result.efficiency, "cpu": efficiency},
            latency={**result.latency, "cpu-gloo": latency},
        )

    start_cpu = [math.log(result.efficiency["cpu"]), math.log(result.latency["cpu-gloo"])]
    return with_cpu(nelder_mead(lambda x: _loss(cpu, with_cpu(x)), start_cpu, iterations=200))


def errors(points, calibration: Calibration = FITTED) -> list[tuple[Point, float, float]]:
    """(point, predicted seconds, relative error) for each point."""
    out = []
    for p in points:
        s = seconds(p, calibration)
        out.append((p, s, s / p.seconds - 1))
    return out


def table(calibration: Calibration = FITTED) -> str:
    """The predicted-vs-published table (Markdown), held-out points marked, with the median and worst errors."""
    rows = errors(POINTS + CPU_POINTS, calibration)
    lines = [
        "| model | device | px | steps | layout | published | predicted | error | fit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, s, e in rows:
        mark = "~" if p.read_off else ""
        where = f"{p.device} {p.link}" + (f", {p.nodes} nodes" if p.nodes > 1 else "")
        lines.append(
            f"| {p.model} | {where} | {p.size} | {p.steps} | {p.layout} | {mark}{p.seconds:g} s | "
            f"{s:.2f} s | {e:+.0%} | {'held out' if p.held_out else 'fitted'} |"
        )
    for name, held_out in (("held out", True), ("fitted", False)):
        chosen = [r for r in rows if r[0].held_out == held_out]
        abs_errors = [abs(e) for _, _, e in chosen]
        lines.append(
            f"\n{name}: {len(chosen)} points, median |error| {statistics.median(abs_errors):.0%}, "
            f"worst {max(abs_errors):.0%}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="xfuse's performance model against published latencies")
    parser.add_argument("--fit", action="store_true", help="refit the constants (a few minutes) and print them")
    args = parser.parse_args(argv)
    calibration = fit() if args.fit else FITTED
    if args.fit:
        print(calibration)
    print(table(calibration))


if __name__ == "__main__":
    main()
