"""Sequence parallelism (Ulysses, Ring, both, and with PipeFusion) in the engine, for every family, against the
independent oracle (``tests/support/pipefusion_oracle.py``; with warm-up = all steps it is diffusers' serial loop).

112 x 96 px: 7 x 6 = 42 image tokens for every family, so 4 SP ranks hold uneven chunks (11, 11, 10, 10) and
M = 2 bands of 24 and 18 tokens; the presets have 2 heads (Ulysses degree 2). CFG is batched [uncond, cond].
"""

import pytest

from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.sequence_fns import inputs_of, run_sequence
from tests.support.world import World

HEIGHT, WIDTH, STEPS = 112, 96, 3
PRESETS = ("tiny", "pixart-tiny", "sd3-tiny", "sd35-tiny", "flux-tiny")
CFG = {"tiny": 5.0, "pixart-tiny": 4.5, "sd3-tiny": 2.0, "sd35-tiny": 2.0, "flux-tiny": 2.0, "flux-small": 2.0}
_ORACLE = {}


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


def oracle(preset, num_patches, warmup):
    key = (preset, num_patches, warmup)
    if key not in _ORACLE:
        pipe, inputs = inputs_of(preset, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=CFG[preset])
        _ORACLE[key] = pipefusion_reference(
            pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=num_patches, warmup=warmup
        )
    return _ORACLE[key]


def rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def run(world, preset, warmup, **layout):
    """Every rank's result: the latents on pipeline rank 0's SP ranks (global ranks 0 … sp - 1), None elsewhere."""
    return world.run_ok(run_sequence, preset, warmup=warmup, height=HEIGHT, width=WIDTH, steps=STEPS,
                        cfg=CFG[preset], **layout)  # fmt: skip


EXACT_LAYOUTS = {
    "ulysses2": dict(ulysses=2),
    "ring2": dict(ring=2),
    "ulysses2xring2": dict(ulysses=2, ring=2),
    "pp2xulysses2": dict(pp=2, ulysses=2, num_patches=2),
    "pp2xring2": dict(pp=2, ring=2, num_patches=2),
}


@pytest.mark.parametrize("layout", EXACT_LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_exact_sequence_parallel_equals_serial(world4, preset, layout):
    """Warm-up = all steps: every SP layout is diffusers' serial loop (max abs ≤ 1e-4, scaled by the latents' size
    where the tiny random models blow them up: PixArt's reach ±300, where one float32 step is 3e-5), and every SP rank
    of the first pipeline rank holds the same latents bit for bit (they step replicated outputs)."""
    results = run(world4, preset, STEPS, **EXACT_LAYOUTS[layout])
    sp = EXACT_LAYOUTS[layout].get("ulysses", 1) * EXACT_LAYOUTS[layout].get("ring", 1)
    serial = oracle(preset, 1, STEPS)
    assert (results[0] - serial).abs().max().item() <= 1e-4 * max(1.0, serial.abs().max().item())
    for other in results[1:sp]:
        assert other.equal(results[0])


PIPELINED = {  # (layout, warm-up)
    "pp1xulysses2 M2": (dict(ulysses=2, num_patches=2), 1),
    "pp2xulysses2 M3": (dict(pp=2, ulysses=2, num_patches=3), 1),
    "pp1xring2 M2": (dict(ring=2, num_patches=2), 1),
    "pp2xring2 M2": (dict(pp=2, ring=2, num_patches=2), 1),
    "ulysses2xring2 M3 W0": (dict(ulysses=2, ring=2, num_patches=3), 0),
}


@pytest.mark.parametrize("layout", PIPELINED)
@pytest.mark.parametrize("preset", PRESETS)
def test_pipelined_sequence_parallel_equals_the_oracle(world4, preset, layout):
    """PipeFusion × Ulysses / Ring with stale K/V: every token's K/V are kept somewhere in the group (Ulysses: all of
    them for the rank's heads; Ring: each patch's ring chunk, the warm-up's handed to their keepers), so the result
    is PipeFusion's with the same patches (the oracle, ≤ 1e-5 relative), not serial's. Warm-up 0: the first step's
    patches see only what was written before them, on every ring rank alike."""
    parallel, warmup = PIPELINED[layout]
    out = run(world4, preset, warmup, **parallel)[0]
    assert rel_max(out, oracle(preset, parallel["num_patches"], warmup)) <= 1e-5
    assert rel_max(oracle(preset, parallel["num_patches"], warmup), oracle(preset, 1, STEPS)) > 1e-4  # stale K/V


@pytest.mark.parametrize("layout", [dict(ulysses=2), dict(ring=2)], ids=["ulysses2", "ring2"])
def test_oracle_catches_misplaced_shard_kv(world4, layout):
    """A patch's K/V written to the wrong range of the buffers (shard bookkeeping) fails the oracle comparison; the
    same run without the fault, in the same processes right after, passes it (the fault was the difference, and it
    did not outlive its run)."""
    for fault, bad in (("misplaced_kv", True), (None, False)):
        out = world4.run_ok(run_sequence, "sd3-tiny", **layout, num_patches=2, warmup=1, height=HEIGHT, width=WIDTH,
                            steps=STEPS, cfg=CFG["sd3-tiny"], fault=fault)[0]  # fmt: skip
        assert (rel_max(out, oracle("sd3-tiny", 2, 1)) > 1e-3) == bad, fault


@pytest.mark.parametrize("ulysses,extra", [(3, {}), (3, {"num_patches": 2}), (2, {"ring": 2})],
                         ids=["ulysses3", "ulysses3 M2", "ulysses2xring2"])  # fmt: skip
def test_ulysses_needs_no_degree_that_divides_the_heads(world4, ulysses, extra):
    """``flux-small`` has 4 heads: Ulysses 3 gives its ranks 2, 1 and 1 of them (text chunked too). Exact mode equals
    serial and the pipelined run (M = 2, warm-up 1) the oracle, as with an even split; Ulysses 2 x Ring 2 on the same
    model is the even split's control."""
    warmup = 1 if "num_patches" in extra else STEPS
    results = run(world4, "flux-small", warmup, ulysses=ulysses, **extra)
    expected = oracle("flux-small", extra.get("num_patches", 1), warmup)
    assert rel_max(results[0], expected) <= (1e-5 if warmup == 1 else 1e-6)
    for other in results[1 : ulysses * extra.get("ring", 1)]:
        assert other.equal(results[0])
