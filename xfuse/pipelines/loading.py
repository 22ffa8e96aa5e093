"""Loading a family's PipeFusion pipeline (``LoadingMixin.from_pretrained`` / ``from_pipe``): the one config
a pipeline runs with, the world joined, and every rank reading only its own transformer blocks from the folder (rank 0
alone the text encoders, tokenizers and, unless every rank decodes a band, the VAE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xfuse.config import (
    ParallelConfig,
    RuntimeConfig,
    XfuseConfig,
    cache_config,
    comm_config,
    compile_config,
    parallel_config,
)
from xfuse.parallel.vae_decode import vae_on_every_rank
from xfuse.pipelines.text_placement import load_text_shares, text_placement
from xfuse.runtime.world import init_parallel
from xfuse.types import DTYPES


def runtime_section(torch_dtype, device) -> RuntimeConfig:
    """The ``runtime`` section of diffusers-style keyword arguments (``torch_dtype=``, ``device=``)."""
    dtype = "float32" if torch_dtype is None else str(torch_dtype).removeprefix("torch.")
    if not isinstance(torch_dtype, (torch.dtype, type(None))) or dtype not in DTYPES:
        allowed = ", ".join(f"torch.{name}" for name in DTYPES)
        raise ValueError(f"torch_dtype must be one of {allowed} (got {torch_dtype!r})")
    device = "auto" if device is None else str(torch.device(device).type)
    return RuntimeConfig(device=device, dtype=dtype)


def one_config(
    config: XfuseConfig | None, model: str, parallel, comm, runtime: Callable[[], RuntimeConfig], cache=None,
    compile=None,
):  # fmt: skip
    """The whole config of a pipeline: ``config`` as given (the CLI and the server pass theirs), or one built from
    diffusers-style keyword arguments (the sections given, defaults elsewhere). Not both."""
    if config is None:
        return XfuseConfig(
            model=model,
            parallel=parallel_config(parallel),
            comm=comm_config(comm),
            cache=cache_config(cache),
            compile=compile_config(compile),
            runtime=runtime(),
            generation=None,  # a pipeline built from Python: its calls carry their own arguments
            serve=None,
        )
    if parallel is not None or comm is not None or cache is not None or compile is not None:
        raise ValueError("pass either config= or the parallel= / comm= / cache= / compile= sections, not both")
    return config


def load_from_folder(cls, pretrained_model_name_or_path: str, parallel, comm, torch_dtype, device, config, dtype,
                     cache, kwargs: dict, compile=None):  # fmt: skip
    """``cls.from_pretrained``'s work (its docstring says what each argument is)."""
    import diffusers

    from xfuse.families.folder import folder_config, pipeline_transformers

    if dtype is not None:
        if torch_dtype is not None:
            raise ValueError("pass either dtype= or torch_dtype= (the same setting), not both")
        torch_dtype = dtype
    if config is not None and (torch_dtype is not None or device is not None):
        raise ValueError("pass either config= or torch_dtype= / device=, not both")
    config = one_config(
        config, pretrained_model_name_or_path, parallel, comm, lambda: runtime_section(torch_dtype, device), cache,
        compile,
    )  # fmt: skip
    torch_dtype = config.runtime.torch_dtype()
    control = cls._control_blocks_of(pretrained_model_name_or_path, kwargs)
    cls.spec.check_adapter(config, controlnet=bool(control))
    context = init_parallel(config)
    if not context.is_output:  # the loading progress bars once, on rank 0, not once per rank
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    vae = folder_config(pretrained_model_name_or_path, "vae")
    vae_class = None if vae is None else vae.get("_class_name", "AutoencoderKL")
    skip = {} if context.is_output else dict.fromkeys(cls._rank0_only(config.parallel, context.world_size, vae_class))
    diffusers_class = getattr(diffusers, cls.diffusers_name())
    model_class = getattr(diffusers, cls.spec.diffusers_transformer)
    transformer = model_class.load_config(pretrained_model_name_or_path, subfolder="transformer", local_files_only=True)
    plan = cls.spec.plan(cls.spec.num_blocks(transformer), config.parallel, control)
    # Only this rank's blocks are read from the checkpoint; diffusers loads the other components.
    stages = {
        name: cls.spec.adapter_class(config.parallel).from_pretrained(
            pretrained_model_name_or_path, plan, context.pipe_rank, torch_dtype, subfolder=name
        )
        for name in pipeline_transformers(pretrained_model_name_or_path)
    }
    pipeline = diffusers_class.from_pretrained(
        pretrained_model_name_or_path,
        dtype=torch_dtype,  # the pinned diffusers' name (its torch_dtype= warns that it is deprecated)
        local_files_only=True,
        **dict.fromkeys(stages),  # transformer=None (and a second expert's)
        **skip,
        **kwargs,
    )
    # A split text encoder's other ranks read it in turn, each keeping only its share before the next reads.
    placement = text_placement(config, context.device)
    load_text_shares(pipeline, pretrained_model_name_or_path, context, placement, torch_dtype)
    stage = stages.pop("transformer")
    return cls(pipeline, context, torch_dtype, stage, stages, vae, text_placement=placement)


def shard_loaded(cls, pipeline, parallel, comm, device, config, cache, compile=None):
    """``cls.from_pipe``'s work (its docstring says what each argument is)."""
    if type(pipeline).__name__ != cls.diffusers_name():
        raise TypeError(f"{cls.__name__}.from_pipe takes a {cls.diffusers_name()} (got {type(pipeline)})")
    dtype = pipeline.transformer.dtype
    if config is not None and device is not None:
        raise ValueError("pass either config= or device=, not both")
    # What the pipeline was loaded from, when diffusers recorded it (a built preset has no folder).
    source = pipeline.config.get("_name_or_path") or cls.diffusers_name()
    config = one_config(config, source, parallel, comm, lambda: runtime_section(dtype, device), cache, compile)
    if config.runtime.torch_dtype() != dtype:
        raise ValueError(f"runtime.dtype is {config.runtime.dtype!r} but the pipeline's transformer is {dtype}")
    cls.spec.check_adapter(config, controlnet=getattr(pipeline, "controlnet", None) is not None)
    return cls(pipeline, init_parallel(config), dtype)


class LoadingMixin:
    """``PipeFusionPipelineBase``'s loading (module docstring): ``from_pretrained``, ``from_pipe``, and what a class
    tells them before the pipeline is built (the components ranks other than 0 skip, a ControlNet's blocks)."""

    def _control_blocks(self, pipeline) -> int:
        """Blocks of a ControlNet the embedding rank runs beside its stage (``ShardedControlNetMixin``); 0: none."""
        return 0

    @classmethod
    def _control_blocks_of(cls, folder: str, kwargs: dict) -> int:
        """``_control_blocks`` of the pipeline ``from_pretrained`` is about to load (before it loads)."""
        return 0

    @classmethod
    def _rank0_only(cls, parallel: ParallelConfig, world_size: int, vae_class: str | None) -> tuple[str, ...]:
        """The components ranks other than 0 do not load: ``rank0_components``, less the VAE when every rank may
        decode a band of the image (``parallel.vae_parallel`` not ``off``, a VAE the bands run: ``vae_class``)."""
        if not vae_on_every_rank(parallel, world_size, vae_class):
            return cls.rank0_components
        return tuple(name for name in cls.rank0_components if name != "vae")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        parallel=None,
        comm=None,
        torch_dtype=None,
        device=None,
        *,
        config: XfuseConfig | None = None,
        dtype=None,
        cache=None,
        compile=None,
        **kwargs,
    ):
        r"""
        Load a local diffusers folder of this family on every rank.

        Args:
            pretrained_model_name_or_path (`str`): local folder with `model_index.json` and the pipeline's
                components, as `save_pretrained` writes it.
            parallel ([`~xfuse.config.ParallelConfig`] or `dict`): parallel degrees, patches, warm-up, placement.
            comm ([`~xfuse.config.CommConfig`] or `dict`): backend, timeout, in-flight bound, interface.
            torch_dtype (`torch.dtype`, *optional*): float32 (default), bfloat16 or float16; `dtype=` is the same
                (the name diffusers now prefers; give one of them).
            device (`str` or `torch.device`, *optional*): `cpu` or `cuda` (default: CUDA when available; each
                rank uses `cuda:LOCAL_RANK`).
            cache ([`~xfuse.config.CacheConfig`] or `dict`, *optional*): step caching (`method`, `threshold`,
                `warmup_steps`, `max_skips`; default off).
            compile ([`~xfuse.config.CompileConfig`] or `dict`, *optional*): regional `torch.compile` of each rank's
                blocks (`mode`, `backend`, `dynamic`, `max_shapes`, `timeout_s`; default off).
            config ([`~xfuse.config.XfuseConfig`], *optional*): the whole config instead of the arguments
                above (what `xfuse generate` and `xfuse serve` pass). Every rank must hold the same: it is compared
                at start-up with the versions, model config and plan, and a difference raises on every rank.
            kwargs: passed to the diffusers pipeline's `from_pretrained` (e.g. `scheduler=`).

        Ranks other than 0 do not load the text encoders, tokenizers or VAE; every rank reads only its own
        transformer blocks from the checkpoint (`transformer/*.safetensors`).
        """
        return load_from_folder(cls, pretrained_model_name_or_path, parallel, comm, torch_dtype, device, config, dtype,
                                cache, kwargs, compile)  # fmt: skip

    @classmethod
    def from_pipe(cls, pipeline, parallel=None, comm=None, device=None, *, config: XfuseConfig | None = None,
                  cache=None, compile=None):  # fmt: skip
        """Parallelise an already loaded diffusers pipeline of this family (the same object on every rank).

        ``config``: the whole config instead of ``parallel``, ``comm``, ``cache``, ``compile`` and ``device`` (its
        ``runtime.dtype`` must be the pipeline's). The pipeline's transformer is sharded in place (blocks of other
        ranks are dropped) and ranks other than 0 drop the text encoders and VAE: do not keep using ``pipeline``
        itself afterwards.
        """
        return shard_loaded(cls, pipeline, parallel, comm, device, config, cache, compile)
