"""Rank functions for the failure tests (importable by spawned ranks)."""

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
