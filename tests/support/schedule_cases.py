"""The schedule cases the pure tests share (``tests/unit/test_schedule.py``, ``test_protocol.py``): every degree
1-8, placement, several M and W, and batch parts, over HunyuanDiT's 16 blocks with their long skips."""

NUM_LAYERS = 16
STEPS = 4


def cases():
    for degree in range(1, 9):
        for placement in ("balanced", "folded", "linear"):
            for m in sorted({1, degree, 2 * degree, 3}):
                for warmup in (0, 1, STEPS):
                    for parts in (1, 2) if warmup else (1,):  # batch parts split whole-image steps only
                        yield degree, placement, m, warmup, parts
