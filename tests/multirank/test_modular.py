"""Modular Diffusers as a second face (``xfuse.parallelize``): diffusers' own modular pipelines of FLUX.1
(``FluxAutoBlocks``), Wan 2.1 (``WanBlocks``), Wan 2.2's two experts (``Wan22Blocks``) and LTX-Video
(``LTXAutoBlocks``, the generic family), the videos with classifier-free guidance through their guiders, run their
blocks on every rank with xfuse's loop in place of their denoise step, on real gloo ranks. Exact mode equals the same
modular pipeline run serially by diffusers alone; pipelined, the latents are those of the same patches and warm-up at
degree 1 (they depend on M and W only), not the serial ones; every rank returns the same latents (rank 0's stepped
latents are broadcast before the pipeline's next block).
"""

import pytest
import torch

from tests.support.modular_fns import (
    CALLS,
    MODULAR,
    flux_modular,
    modular_latents,
    modular_pipeline,
    parallel_modular_latents,
)
from tests.support.world import World
from xfuse.families.registry import MODEL_SPECS

EXACT = {"warmup_steps": 100}  # warm-up covers every step
LAYOUTS = {  # name -> (world size, parallel section)
    "pp2": (2, {"pipefusion_degree": 2, "num_patches": 3}),
    "pp3": (3, {"pipefusion_degree": 3, "num_patches": 4}),
    "pp2_ulysses2": (4, {"pipefusion_degree": 2, "ulysses_degree": 2}),
    "pp2_generic": (2, {"pipefusion_degree": 2, "num_patches": 3, "adapter": "generic"}),
    "cfg2_pp2": (4, {"pipefusion_degree": 2, "cfg_degree": 2}),
}
CASES = [
    *[("flux", name) for name in ("pp2", "pp3", "pp2_ulysses2", "pp2_generic")],
    ("flux-img2img", "pp2"),  # the same denoise step on an image's noised latents and the timesteps left
    *[("wan", name) for name in ("pp2", "cfg2_pp2", "pp2_generic")],  # Wan's guider: a CFG batch the groups split
    *[("wan2.2", name) for name in ("pp2", "cfg2_pp2")],  # two experts, each with its guider
    *[("ltx", name) for name in ("pp2", "pp3", "cfg2_pp2")],  # (LTX-Video: the generic family only)
]
SHAPES = {
    "flux": (1, 4, 16, 12),
    "flux-img2img": (1, 4, 16, 12),
    "wan": (1, 4, 3, 8, 12),
    "wan2.2": (1, 4, 3, 8, 12),
    "ltx": (1, 8, 2, 4, 3),
}  # FLUX.1 unpacked by the pipeline's own next block


@pytest.fixture(scope="module")
def worlds():
    made: dict[int, World] = {}

    def world(size: int) -> World:
        if size not in made:
            for other in made.values():  # one world at a time: 4 ranks on this machine's 2 cores
                other.close()
            made.clear()
            made[size] = World(size, start_timeout=240)
        return made[size]

    yield world
    for w in made.values():
        w.close()


@pytest.fixture(scope="module")
def serials():
    made: dict[str, torch.Tensor] = {}

    def serial(family: str) -> torch.Tensor:
        if family not in made:
            made[family] = modular_latents(modular_pipeline(family), CALLS[family])  # diffusers alone
        return made[family]

    return serial


def rel_max(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("family,layout", CASES)
def test_exact_mode_equals_the_serial_modular_pipeline_on_every_rank(worlds, serials, family, layout):
    size, parallel = LAYOUTS[layout]
    results = worlds(size).run_ok(parallel_modular_latents, {**parallel, **EXACT}, family, timeout=300)
    latents, blocks = results[0]
    serial = serials(family)
    assert "ParallelDenoiseStep" in blocks and not set(MODEL_SPECS[MODULAR[family][2]].modular_denoise) & set(blocks)
    assert latents.shape == serial.shape == SHAPES[family]
    assert rel_max(latents, serial) <= 1e-4, layout
    for rank, (other, _) in enumerate(results[1:], 1):
        assert torch.equal(other, latents), rank  # every rank goes on with rank 0's latents


def test_every_rank_decodes_the_image_diffusers_decodes(worlds):
    """The pipeline's own decode step runs on every rank (its VAE left whole): pp2, exact, images as numpy."""
    serial = modular_latents(flux_modular(), output="images")
    results = worlds(2).run_ok(parallel_modular_latents, {"pipefusion_degree": 2, **EXACT}, output="images",
                               timeout=300)  # fmt: skip
    for rank, (images, _) in enumerate(results):
        assert images.shape == serial.shape == (1, 128, 96, 3), rank
        assert abs(images - serial).max() <= 1e-4, rank


@pytest.mark.parametrize("family", ["flux", "wan", "wan2.2", "ltx"])
def test_pipelined_equals_the_same_patches_at_degree_1_not_serial(worlds, serials, family):
    """pp2 and pp3 with M = 3 and one warm-up step equal the degree-1 engine's latents for M = 3, W = 1."""
    pipelined = {"num_patches": 3, "warmup_steps": 1}
    alone, _ = parallel_modular_latents({"pipefusion_degree": 1, **pipelined}, family)
    assert rel_max(alone, serials(family)) > 1e-4  # stale K/V matter: a run that fell back to serial fails
    for degree in (2, 3):
        latents, _ = worlds(degree).run_ok(parallel_modular_latents, {"pipefusion_degree": degree, **pipelined},
                                           family, timeout=300)[0]  # fmt: skip
        assert rel_max(latents, alone) <= 1e-5, degree
