"""Rank functions for the failure tests (importable by spawned ranks)."""

import os
import traceback

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


def generate_then_exit(argv: list[str], env: dict[str, str], log_dir: str) -> None:
    """On every rank of a fresh ``tests.support.world.World``: ``xfuse generate`` as a rank torchrun started runs it
    (``RANK`` and ``WORLD_SIZE`` set, ``env`` added: the drill's ``XFUSE_FAULT``), its file descriptors 1 and 2 written
    to ``log_dir/rank{R}.out`` and ``.err`` from the start (a report written just before ``os._exit`` or a SIGKILL is
    kept, faulthandler's dump too); then the process ends with the command's exit code, as ``python -m xfuse`` ends.
    The failure paths end it sooner themselves (``os._exit`` from the monitor's thread, faulthandler's timer, the
    fault's SIGKILL): the world's ``run`` reads each rank's end as ``RankDied`` with its exit code, the rank's
    exit code under torchrun."""
    import sys

    from xfuse import cli

    rank = dist.get_rank()
    for fd, suffix in ((1, "out"), (2, "err")):
        log = os.open(os.path.join(log_dir, f"rank{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process ends below
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(dist.get_world_size()), **env})
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - python -m xfuse would print it and exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def generate_on_a_fresh_world(degree: int, argv: list[str], env: dict[str, str], log_dir, timeout: float = 120):
    """``xfuse generate ARGV`` with ``env`` on the ranks of a fresh ``World(degree)`` (``generate_then_exit``); return
    (the first non-zero exit code of its ranks or 0, every rank's stderr in rank order, the POSIX time the last rank
    ended)."""
    import datetime

    from tests.support.world import RankDied, World

    with World(degree) as world:
        results = world.run(generate_then_exit, argv, env, str(log_dir), timeout=timeout)
        end = datetime.datetime.now().timestamp()
    stderr = "".join(open(os.path.join(log_dir, f"rank{rank}.err")).read() for rank in range(degree))
    assert all(isinstance(result.error, RankDied) for result in results), (results, stderr[-3000:])
    return next((result.error.exitcode for result in results if result.error.exitcode), 0), stderr, end
