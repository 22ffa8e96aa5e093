"""The memory side of ``xfuse plan --auto`` (``xfuse.perf.memory``): layouts whose busiest rank would not hold its
weights and stale K/V on the device are dropped, naming the rank and how much it needs."""

import re

import pytest
import torch
from diffusers import Flux2Transformer2DModel

from xfuse.config import config_from_dict
from xfuse.families.registry import transformer_config
from xfuse.perf.hardware import DEVICES
from xfuse.perf.memory import GIB
from xfuse.perf.model import machine
from xfuse.perf.planner import busiest_rank, format_ranking, rank_layouts, workload

NEEDS = re.compile(r"does not fit: pipeline rank (\d+) needs ([\d.]+) GiB \(weights ([\d.]+), stale K/V ([\d.]+)\) "
                   r"of ([\d.]+) GiB")  # fmt: skip


def _config(model: str):
    return config_from_dict({"model": model, "generation": {"height": 1024, "width": 1024, "num_inference_steps": 20}})


def test_flux2_dev_on_four_l40s_ranks_only_layouts_that_fit():
    """FLUX.2 [dev] is 32 B parameters, 60 GiB in bf16: Ulysses 4 and Ring 4 keep all of it on every rank and are
    dropped on 48 GB L40s, each with the rank's need (its weights: the whole transformer, counted independently
    here on a weightless model); PipeFusion 4 fits and is chosen; every ranked layout's busiest rank fits."""
    config, where = _config("flux2-dev"), machine("l40", "pcie", 4)
    ranked, refused = rank_layouts(config, 4, where)
    names = [r.name for r in ranked]
    assert names[0] == "pipefusion 4" and "ulysses 4" not in names and "ring 4" not in names
    with torch.device("meta"):
        whole = sum(p.numel() for p in Flux2Transformer2DModel(**transformer_config("flux2-dev")).parameters())
    for layout in ("ulysses 4", "ring 4", "ulysses 2 x ring 2"):
        (reason,) = [r for r in refused if r.startswith(f"{layout}: ")]
        rank, needs, weights, kv, device = NEEDS.search(reason).groups()
        assert rank == "0" and float(device) == pytest.approx(DEVICES["l40"].memory / GIB, abs=0.05)
        assert float(weights) == pytest.approx(2 * whole / GIB, abs=0.05)  # bf16
        assert float(needs) == pytest.approx(float(weights) + float(kv), abs=0.1) and float(needs) > float(device)
    work = workload(config)
    for r in ranked:
        assert busiest_rank(config.model, work, r.parallel, 2).total <= DEVICES["l40"].memory, r.name
    text = format_ranking(config, 4, where)
    assert "ring 4: does not fit: pipeline rank 0 needs" in text
    assert "activations, text encoders and the VAE on rank 0 not counted" in text


def test_a_model_that_fits_everywhere_loses_no_layout_and_the_cpu_has_no_limit():
    config = _config("flux-dev")  # FLUX.1 [dev]: 12 B, 22 GiB in bf16, fits an L40 whole
    ranked, refused = rank_layouts(config, 4, machine("l40", "pcie", 4))
    assert len(ranked) == 6 and not [r for r in refused if "does not fit" in r]
    assert DEVICES["cpu"].memory is None
    ranked, refused = rank_layouts(_config("flux2-small"), 2, machine("cpu", "gloo", 2))
    assert ranked and not [r for r in refused if "does not fit" in r]
