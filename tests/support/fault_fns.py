"""Rank functions for the failure tests (importable by spawned ranks)."""

import os

import torch.distributed as dist


def start_with_config(paths):
    """Every rank builds the pipeline from its own YAML file (paths[rank]); returns the error it got."""
    from xfuse import PipeFusionHunyuanDiTPipeline
    from xfuse.config.io import load_config
    from xfuse.families.registry import load_pipeline

    config = load_config(paths[dist.get_rank()])
    try:
        PipeFusionHunyuanDiTPipeline.from_pipe(load_pipeline(config.model), config=config)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err)
    return None


def build_errors(folder, kwargs_list):
    """Each from_pretrained(**kwargs) attempt's (error type, message), or None if it built."""
    from xfuse import PipeFusionHunyuanDiTPipeline

    results = []
    for kwargs in kwargs_list:
        try:
            PipeFusionHunyuanDiTPipeline.from_pretrained(folder, **kwargs)
            results.append(None)
        except Exception as err:  # noqa: BLE001
            results.append((type(err).__name__, str(err)))
    return results


def passes_until_the_fault(spec: str, placement: str, timeout_s: float):
    """PipeFusion on the tiny model (2 ranks, 2 patches, warm-up 1, CFG) with ``spec`` armed; every rank records
    the (B, tokens, hidden) shape of each pass of its first block, in a hook registered before the fault's.
    Returns (error type, message, shapes)."""
    from tests.support.engine_fns import run_engine
    from xfuse.runtime.faults import install

    shapes = []

    def arm(stage):
        stage.blocks[stage.block_ids[0]].register_forward_pre_hook(lambda module, args: shapes.append(args[0].shape))
        install(stage, dist.get_rank(), spec)

    try:
        run_engine(2, placement, 2, 1, steps=4, timeout_s=timeout_s, on_stage=arm)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return type(err).__name__, str(err), [tuple(shape) for shape in shapes]
    return None, None, [tuple(shape) for shape in shapes]


def generate_on_a_fresh_world(degree: int, argv: list[str], env: dict[str, str], log_dir, timeout: float = 120):
    """``xfuse generate ARGV`` with ``env`` on the ranks of a fresh ``World(degree)`` (``command_then_exit``, each
    rank's output in ``log_dir/rank{R}.out`` and ``.err``); return (the first non-zero exit code of its ranks or 0,
    every rank's stderr in rank order, the POSIX time the last rank ended)."""
    import datetime

    from tests.support.cli_fns import command_then_exit
    from tests.support.world import World, exit_code

    logs = os.path.join(log_dir, "rank{rank}")
    with World(degree) as world:
        results = world.run(command_then_exit, argv, env, logs + ".out", logs + ".err", timeout=timeout)
        end = datetime.datetime.now().timestamp()
    stderr = "".join(open(os.path.join(log_dir, f"rank{rank}.err")).read() for rank in range(degree))
    return exit_code(results, "\n" + stderr[-3000:]), stderr, end
