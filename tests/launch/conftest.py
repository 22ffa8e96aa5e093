"""The launch tier's shared fixture: the module's 2-rank world, on which the command line runs where the launch is not
the case (``tests.support.cli_fns.on_ranks``) and the trained models' pipelined runs draw."""

import pytest

from tests.support.world import World


@pytest.fixture(scope="module")
def ranks():
    """A 2-rank gloo world, one per module that asks for it (started in about a second from the preloaded fork
    server; 300 s allowed on a loaded machine)."""
    with World(2, start_timeout=300) as world:
        yield world
