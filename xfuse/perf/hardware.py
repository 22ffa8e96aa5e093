"""The machines the performance model knows: devices (spec-sheet throughput and memory bandwidth) and links.

Spec-sheet figures are facts, not fits: dense bf16 tensor throughput and memory bandwidth from the vendors' data
sheets; links as effective NCCL point-to-point rates between two GPUs (not the marketing peak). What a device reaches
on a given family's blocks is fitted (``xfuse.perf.calibration``), never written here.
"""

from __future__ import annotations

from dataclasses import dataclass

from xfuse.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (fp32 for the CPU)
    memory_bandwidth: float  # bytes per second
    dtype_bytes: int = 2  # what its runs compute and send in (bf16 on GPUs, fp32 on the CPU)
    gpu: bool = True  # the model's time outside the loop (text encoders, VAE decode) is fitted for GPUs only
    memory: float | None = None  # bytes a process can allocate (nvidia-smi's total); None: not limited by the plan
    # A device no published point measures takes the fitted efficiency of its kin (the same chip: an RTX 4090 and
    # an L40 are both AD102; an A100 40GB the A100 80GB's SMs), and its links where it has none of its own.
    kin: str | None = None
    # Host-to-device copy rate (an offloaded text encoder's weights cross it every prompt): PCIe 4.0 x16's effective
    # rate, PCIe 5.0's for the H100. An assumption from the bus, not measured here.
    host_bandwidth: float = 25e9


@dataclass(frozen=True)
class Link:
    """What two ranks send each other over, per direction.

    ``overlap``: a transfer proceeds while the rank computes (a GPU's copy engines and NCCL kernels); gloo's
    copies take the CPU rank's own core, so nothing hides behind compute there.
    ``shared``: the ranks of a collective share one bottleneck (PCIe through the host bridge and across sockets, an
    Ethernet NIC per node): a group of g ranks exchanging at once gets ``bandwidth * 2 / g`` each from g = 3 on,
    where NVSwitch gives every pair its full rate. An assumption, stated: xDiT's PCIe tables are what it is checked
    against (Ulysses' collapse on 8 x L40).
    """

    name: str
    bandwidth: float  # bytes per second per direction between two ranks
    latency: float  # seconds per message
    shared: bool = False
    overlap: bool = True

    def group_bandwidth(self, group: int) -> float:
        """Per-rank bandwidth when ``group`` ranks exchange at once (an all-to-all, a ring step)."""
        return self.bandwidth * 2 / group if self.shared and group > 2 else self.bandwidth


DEVICES = {
    # memory: nvidia-smi's total of each card (MiB)
    "a100": Device("A100 SXM 80GB", 312e12, 2.04e12, memory=81920 * 2**20),
    "h100": Device("H100 SXM 80GB", 989e12, 3.35e12, memory=81559 * 2**20, host_bandwidth=50e9),
    "a100-40gb": Device("A100 SXM 40GB", 312e12, 1.555e12, memory=40960 * 2**20, kin="a100"),
    "l40": Device("L40 48GB", 181e12, 0.864e12, memory=46068 * 2**20),
    # GeForce: dense bf16 with fp32 accumulation (the Ada whitepaper's 165.2 TFLOPS), no P2P between the cards.
    "rtx4090": Device("RTX 4090 24GB", 165.2e12, 1.008e12, memory=24564 * 2**20, kin="l40"),
    # This machine's CPU rank (one torch thread, fp32): its throughput is fitted to the measured single-rank run,
    # so the nominal peak only sets the scale of the fitted efficiency.
    "cpu": Device("CPU rank (1 thread, fp32)", 100e9, 20e9, dtype_bytes=4, gpu=False),
}

# Other names a user may give --device (the issue tracker's and vendors' own): the A100 without a size is the 80 GB.
DEVICE_ALIASES = {"a100-80gb": "a100"}

LINKS = {
    "a100-nvlink": Link("A100 NVLink 3 / NVSwitch", 200e9, 10e-6),
    "h100-nvlink": Link("H100 NVLink 4 / NVSwitch", 350e9, 10e-6),
    "l40-pcie": Link("L40 PCIe 4.0 x16 (P2P through the host)", 14e9, 25e-6, shared=True),
    "a100-pcie": Link("A100 PCIe 4.0 x16", 20e9, 25e-6, shared=True),
    # GeForce cards have no peer-to-peer: NCCL stages each message through host memory (an assumption, not measured).
    "rtx4090-pcie": Link("RTX 4090 PCIe 4.0 x16 (no P2P: through host memory)", 10e9, 30e-6, shared=True),
    "ethernet": Link("100 GbE between nodes", 11e9, 50e-6, shared=True),
    # Two CPU ranks over gloo on loopback: xfuse's P2P exchange of 1.2 MB measured at 0.70 ms on this machine
    # (docs/performance.md). Its latency is fitted (``Calibration.latency``): inside a layer it is the rendezvous
    # of two busy ranks, not a wire's.
    "cpu-gloo": Link("gloo on loopback (2 cores)", 2.5e9, 0.2e-3, overlap=False),
}

LINK_KINDS = ("nvlink", "pcie", "gloo")


def link_key(device: str, link: str) -> str:
    """The ``LINKS`` key of the link between two ``device``s of one node over ``link`` (``nvlink``, ``pcie``, or
    ``gloo`` for CPU ranks; a device without links of its own takes its kin's); ``ConfigError`` naming ``--link``
    with the pairs that exist."""
    key = f"{device}-{link}"
    if key not in LINKS and DEVICES[device].kin is not None:
        key = f"{DEVICES[device].kin}-{link}"
    if key not in LINKS:
        pairs = sorted(k for k in LINKS if k.split("-")[0] in DEVICES)
        raise ConfigError("--link", f"no {link!r} link is known for {device!r}; one of {pairs} (device-link)")
    return key
