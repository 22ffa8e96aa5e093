"""Validated configuration for xfuse, on pydantic: the package's public face (``from xfuse.config import XfuseConfig,
ParallelConfig, ...``).

The sections and the whole config are pure: no process group, no environment changes, no device queries, no file
reads at import or construction (``torch`` is not even imported). Each section is a frozen, strict pydantic model
(``"2"`` is not 2, ``True`` is not 1, floats are finite, unknown keys are refused): pydantic checks the values against
the field types, their ranges and the allowed values in :mod:`xfuse.types`; one ``model_validator`` per rule that reads
two keys. YAML files and ``--set`` overrides are read by :mod:`xfuse.config.io` (not imported here); the files a
config names are checked where they are opened (``xfuse.build.check_files``).

Every error is a :class:`ConfigError` whose ``.key`` is the full dotted key (``parallel.cfg_degree``) and whose
message reads ``<dotted.key>: <what is wrong and what is allowed> (got <repr>)`` (:mod:`xfuse.config.messages` words
pydantic's findings so).

YAML layout (every key optional)::

    model: tiny                      # local diffusers folder, a preset (xfuse.families.registry), or shapes
    parallel: {pipefusion_degree: 2, num_patches: null, warmup_steps: 1, cfg_degree: 1,
               placement: null, stage_split: null, ulysses_degree: 1, ring_degree: 1,
               vae_parallel: auto, video_patches: temporal,
               text_encoder: auto}   # placement null: the model family's default
    comm:     {backend: auto, timeout_s: 60.0, max_inflight: 2, socket_ifname: null, wait: auto,
               host_timeout_s: auto}
    cache:    {method: off, threshold: 0.05, warmup_steps: 0, max_skips: null}
    compile:  {mode: off, backend: inductor, dynamic: false, warmup_sizes: [], max_shapes: 8, cache_dir: null,
               timeout_s: 900.0}
    runtime:  {device: auto, dtype: float32}
    generation: {prompt: "...", negative_prompt: null, height: null, width: null,
                 num_inference_steps: 20, guidance_scale: 5.0, seed: 0,
                 num_frames: null, fps: 16, image: null,     # num_frames, fps, image: video models only (Wan)
                 lora: {}, controlnet: null, control_image: null, controlnet_conditioning_scale: 1.0,
                 control_guidance_start: 0.0, control_guidance_end: 1.0}   # xfuse generate's LoRA and ControlNet
    serve:    {host: 127.0.0.1, port: 8000, model_name: null, max_queue: 8, max_queued_work: auto,
               max_images_per_request: 4, max_batch: 1, batch_max_pixels: 262144, max_inflight: 1,
               max_side: 2048, max_pixels: 4194304, max_steps: 100, max_prompt_chars: 4000,
               max_body_bytes: 1048576, request_timeout_s: 300.0, heartbeat_interval_s: 1.0,
               heartbeat_timeout_s: 2.0, lora_adapters: {}}   # xfuse serve only; generation: the requests' defaults

Where each part lives: :mod:`~xfuse.config.section` (the sections' base and shared value types),
:mod:`~xfuse.config.messages` (the error wording), :mod:`~xfuse.config.parallel` (``parallel``),
:mod:`~xfuse.config.runtime` (``comm``, ``runtime``), :mod:`~xfuse.config.speed` (``cache``, ``compile``),
:mod:`~xfuse.config.requests` (``generation``, ``serve``), :mod:`~xfuse.config.whole` (:class:`XfuseConfig`,
``SECTIONS``, :func:`config_from_dict`), :mod:`~xfuse.config.io` (YAML and ``--set``).

Checks that need the model (block count, patch size, image size) are its family's (``ModelSpec.check_layout``), and
the world size is checked where the world is joined (``xfuse.runtime.world.init_parallel``); both run before any
communication.
"""

from xfuse.config.parallel import MAX_PIPEFUSION_DEGREE, MAX_SEQUENCE_DEGREE, ParallelConfig
from xfuse.config.requests import MAX_SEED, GenerationConfig, ServeConfig
from xfuse.config.runtime import CommConfig, RuntimeConfig
from xfuse.config.speed import CacheConfig, CompileConfig
from xfuse.config.whole import (
    SECTIONS,
    TOP_LEVEL_KEYS,
    XfuseConfig,
    cache_config,
    comm_config,
    compile_config,
    config_from_dict,
    parallel_config,
)
from xfuse.errors import ConfigError

__all__ = ["MAX_PIPEFUSION_DEGREE", "MAX_SEED", "MAX_SEQUENCE_DEGREE", "SECTIONS", "TOP_LEVEL_KEYS", "ConfigError"]
__all__ += [
    "CacheConfig",
    "CommConfig",
    "CompileConfig",
    "GenerationConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ServeConfig",
]
__all__ += ["XfuseConfig", "cache_config", "comm_config", "compile_config", "config_from_dict", "parallel_config"]
