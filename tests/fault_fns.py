"""Rank functions for the failure tests (importable by spawned ranks)."""

import torch.distributed as dist


def start_with_config(paths):
    """Every rank builds the pipeline from its own YAML file (paths[rank]); returns the error it got."""
    from xfuse.config import load_config
    from xfuse.health import flatten
    from xfuse.models import load_pipeline
    from xfuse.pipelines import PipeFusionHunyuanDiTPipeline

    config = load_config(paths[dist.get_rank()])
    try:
        PipeFusionHunyuanDiTPipeline.from_pipe(
            load_pipeline(config.model),
            parallel=config.parallel,
            comm=config.comm,
            fingerprint=flatten("", {"generation": config.to_dict()["generation"]}),
        )
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
