"""Latencies others published (xDiT's performance pages) and ones measured here, that the model is fitted to and
judged by.

xDiT's figures are eager PyTorch, bf16, whole pipeline call including the VAE decode, its linear placement with
M = pipefusion degree and one whole warm-up step (its defaults). Values marked ``read_off`` were read from a chart's
axis (about +-0.3 s at 1024 px, +-1 s at 2048 px), the others are printed labels or tables. Sources:
``xDiT docs/performance/*.md`` and the charts they embed (commit 175e0bf), summarised in the team's research notes.

``held_out``: not used by the fit, only to report its error: every GPU point with more than two devices (every
hybrid and every 4- and 8-GPU figure; the fit sees single-GPU and 2-GPU points). On this machine's CPU the fit sees
the single rank (the rank's throughput) and Ulysses 2 (gloo's cost per exchange between two busy ranks); Ring 2 and
PipeFusion 2 are held out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    model: str  # a preset with the released transformer shape (``xfuse plan`` knows it)
    device: str  # key of ``xfuse.perf.hardware.DEVICES``
    link: str  # nvlink | pcie | gloo
    size: int  # square image side, px
    steps: int
    seconds: float
    cfg: int = 1
    pipefusion: int = 1
    ulysses: int = 1
    ring: int = 1
    source: str = ""
    read_off: bool = False
    decoded: bool = True  # the time includes the VAE decode (False: the call to latents, as this machine's bench)
    fitted: bool | None = None  # the fit sees it; None: the rule above (at most two devices)
    nodes: int = 1  # over 100 GbE between them

    @property
    def gpus(self) -> int:
        return self.cfg * self.pipefusion * self.ulysses * self.ring

    @property
    def held_out(self) -> bool:
        return not self.fitted if self.fitted is not None else self.gpus > 2

    @property
    def layout(self) -> str:
        parts = [f"{k}{v}" for k, v in (("cfg", self.cfg), ("pp", self.pipefusion), ("u", self.ulysses),
                                          ("r", self.ring)) if v > 1]  # fmt: skip
        return " x ".join(parts) or "1 device"


_HY_A100 = "xDiT hunyuandit.md, Hunyuan-A100-crop.png"
_FLUX_A100 = "xDiT flux.md, Flux-A100-crop.png (labels)"
_FLUX_H100 = "xDiT flux.md, 4xH100 table"
_FLUX_L40 = "xDiT flux.md, Flux-16L40-crop.png"
_SD3 = "xDiT sd3.md"
_HERE = "benchmarks/bench_sequence.py on this machine (sequence.json, 2026-11-25 03:33 UTC)"

POINTS: tuple[Point, ...] = (
    # HunyuanDiT-v1.2, 8 x A100 NVLink, 50 steps (one chart: every method at 1, 2, 4, 8 GPUs)
    Point("dit-g2", "a100", "nvlink", 1024, 50, 19.9, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 12.5, pipefusion=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 9.0, pipefusion=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 7.3, pipefusion=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 13.7, ulysses=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 8.7, ulysses=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 8.3, ulysses=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 13.3, ring=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 11.1, ring=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 11.4, ring=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 8.4, cfg=2, pipefusion=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 1024, 50, 5.9, cfg=2, pipefusion=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 90.23, source=_HY_A100),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 57.5, pipefusion=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 51.0, pipefusion=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 50.7, pipefusion=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 61.5, ulysses=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 33.5, ulysses=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 20.5, ulysses=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 61.0, ring=2, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 35.0, ring=4, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 22.0, ring=8, source=_HY_A100, read_off=True),
    Point("dit-g2", "a100", "nvlink", 2048, 50, 16.46, cfg=2, pipefusion=2, ring=2, source=_HY_A100),
    # FLUX.1-dev, 1024 px, 28 steps
    Point("flux-dev", "a100", "nvlink", 1024, 28, 12.77, source=_FLUX_A100),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 8.16, ulysses=2, source=_FLUX_A100),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 5.55, ulysses=4, source=_FLUX_A100),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 4.13, ulysses=8, source=_FLUX_A100),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 8.6, pipefusion=2, source=_FLUX_A100, read_off=True),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 6.3, pipefusion=4, source=_FLUX_A100, read_off=True),
    Point("flux-dev", "a100", "nvlink", 1024, 28, 5.4, pipefusion=8, source=_FLUX_A100, read_off=True),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 6.71, source=_FLUX_H100),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 4.38, ulysses=2, source=_FLUX_H100),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 5.31, ring=2, source=_FLUX_H100),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 5.19, ulysses=2, ring=2, source=_FLUX_H100),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 4.24, ulysses=4, source=_FLUX_H100),
    Point("flux-dev", "h100", "nvlink", 1024, 28, 5.11, ring=4, source=_FLUX_H100),
    Point("flux-dev", "l40", "pcie", 1024, 28, 18.36, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 1024, 28, 11.03, pipefusion=2, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 1024, 28, 7.05, pipefusion=4, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 1024, 28, 5.53, pipefusion=8, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 1024, 28, 26.0, ulysses=8, source=_FLUX_L40, read_off=True),
    Point("flux-dev", "l40", "pcie", 2048, 28, 105.7, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 2048, 28, 58.15, pipefusion=2, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 2048, 28, 30.1, pipefusion=4, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 2048, 28, 18.68, pipefusion=8, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 2048, 28, 76.0, ulysses=8, source=_FLUX_L40, read_off=True),
    # two 8 x L40 nodes over Ethernet: the best hybrids' printed labels
    Point("flux-dev", "l40", "pcie", 1024, 28, 4.78, pipefusion=4, ulysses=4, nodes=2, source=_FLUX_L40),
    Point("flux-dev", "l40", "pcie", 4096, 28, 70.32, pipefusion=4, ulysses=2, ring=2, nodes=2, source=_FLUX_L40),
    # SD3-medium, 1024 px, 20 steps
    Point("sd3-medium", "a100", "nvlink", 1024, 20, 3.09, source=_SD3),
    Point("sd3-medium", "a100", "nvlink", 1024, 20, 1.73, cfg=2, source=_SD3),
    Point("sd3-medium", "a100", "nvlink", 1024, 20, 1.31, cfg=2, pipefusion=2, source=_SD3),
    Point("sd3-medium", "a100", "nvlink", 1024, 20, 0.90, cfg=2, pipefusion=4, source=_SD3),
    Point("sd3-medium", "l40", "pcie", 1024, 20, 3.92, source=_SD3),
    Point("sd3-medium", "l40", "pcie", 1024, 20, 2.18, cfg=2, source=_SD3),
    Point("sd3-medium", "l40", "pcie", 1024, 20, 1.52, cfg=2, pipefusion=2, source=_SD3),
    Point("sd3-medium", "l40", "pcie", 1024, 20, 1.26, cfg=2, pipefusion=4, source=_SD3),
)

# Measured here (xfuse, flux-small, fp32, one thread per rank, the call to latents, medians of 3 in turns): what
# ``xfuse plan --auto --gpus 2 --link gloo`` must order as the benchmark does.
CPU_POINTS: tuple[Point, ...] = (
    Point("flux-small", "cpu", "gloo", 512, 20, 13.97, source=_HERE, decoded=False, fitted=True),
    Point("flux-small", "cpu", "gloo", 512, 20, 8.85, ulysses=2, source=_HERE, decoded=False, fitted=True),
    Point("flux-small", "cpu", "gloo", 512, 20, 8.40, ring=2, source=_HERE, decoded=False, fitted=False),
    Point("flux-small", "cpu", "gloo", 512, 20, 7.88, pipefusion=2, source=_HERE, decoded=False, fitted=False),
)
