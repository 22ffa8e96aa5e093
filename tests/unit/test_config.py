"""Tests for xfuse.config: defaults, YAML round trip, overrides, section inputs, bad configs, world checks."""

from __future__ import annotations

import re
import subprocess
import sys

import pydantic
import pytest
import yaml

from tests.support import REPO
from xfuse.build import check_files
from xfuse.config import (
    CacheConfig,
    CommConfig,
    ConfigError,
    GenerationConfig,
    ParallelConfig,
    RuntimeConfig,
    XfuseConfig,
    cache_config,
    comm_config,
    config_from_dict,
    parallel_config,
)
from xfuse.config.io import load_config, parse_override
from xfuse.families.registry import HUNYUANDIT, model_is_preset
from xfuse.runtime.world import check_world_size

CONFIG_FILES = sorted((REPO / "configs").rglob("*.yaml"))


def _write(tmp_path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------------------------------------------------------
# Defaults and basics
# ------------------------------------------------------------------------------------------------------------------


def test_defaults():
    c = XfuseConfig()
    assert c == load_config() == config_from_dict({}) == config_from_dict(None)
    assert c.model == "tiny" and model_is_preset(c.model)
    p = c.parallel
    assert (p.pipefusion_degree, p.num_patches, p.warmup_steps, p.cfg_degree, p.placement, p.stage_split) == (
        1,
        None,
        1,
        1,
        None,  # placement: the model family's default (ModelSpec.default_placement)
        None,
    )
    assert p.resolved_num_patches == 1
    assert (c.comm.backend, c.comm.timeout_s, c.comm.max_inflight, c.comm.socket_ifname) == ("auto", 60.0, 2, None)
    assert (c.runtime.device, c.runtime.dtype) == ("auto", "float32")
    g = c.generation
    assert isinstance(g.prompt, str) and g.prompt
    assert (g.negative_prompt, g.height, g.width, g.num_inference_steps, g.guidance_scale, g.seed) == (
        None,
        None,
        None,
        20,
        5.0,
        0,
    )
    assert c.world_size == 1
    assert (g.num_frames, g.fps) == (None, 16)  # video models only: the model's clip, Wan 2.1's frame rate


def test_import_has_no_side_effects():
    # No torch import, no process group, no env changes from importing and constructing.
    code = (
        "import os, sys; before = dict(os.environ); import xfuse.config.io as m; m.load_config(); m.XfuseConfig(); "
        "assert 'torch' not in sys.modules, 'torch imported'; assert dict(os.environ) == before"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_num_patches_resolution_keeps_user_value():
    p = ParallelConfig(pipefusion_degree=4)
    assert p.num_patches is None and p.resolved_num_patches == 4
    p = ParallelConfig(pipefusion_degree=4, num_patches=2)  # fewer patches than stages: allowed, never changed
    assert p.num_patches == 2 and p.resolved_num_patches == 2
    p = ParallelConfig(pipefusion_degree=2, num_patches=16)
    assert p.resolved_num_patches == 16


def test_world_size_and_frozen():
    c = config_from_dict({"parallel": {"pipefusion_degree": 4, "cfg_degree": 2}})
    assert c.world_size == 8
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.parallel.pipefusion_degree = 2  # type: ignore[misc]
    # with_changes re-validates (model_copy(update=...) would not), the cross-field rules included
    assert c.parallel.with_changes(pipefusion_degree=2) == ParallelConfig(pipefusion_degree=2, cfg_degree=2)
    with pytest.raises(ConfigError) as e:
        c.parallel.with_changes(pipefusion_degree=9)
    assert e.value.key == "parallel.pipefusion_degree"
    with pytest.raises(ConfigError) as e:
        c.parallel.with_changes(stage_split=[4, 4, 4])
    assert e.value.key == "parallel.stage_split" and "3 entries" in str(e.value)
    with pytest.raises(ConfigError) as e:
        c.with_changes(generation={"guidance_scale": 1.0})
    assert e.value.key == "parallel.cfg_degree"


def test_normalisation_and_hashable():
    p = ParallelConfig(pipefusion_degree=2, stage_split=[3, 5])
    assert p.stage_split == (3, 5)
    hash(p)
    c = CommConfig(timeout_s=30)
    assert c.timeout_s == 30.0 and isinstance(c.timeout_s, float)
    assert GenerationConfig(guidance_scale=7).guidance_scale == 7.0


def test_backend_resolution_is_pure():
    assert CommConfig().resolved_backend("cuda") == "nccl"
    assert CommConfig().resolved_backend("cpu") == "gloo"
    assert CommConfig(backend="gloo").resolved_backend("cuda") == "gloo"


def test_torch_dtype():
    torch = pytest.importorskip("torch")
    assert RuntimeConfig(dtype="bfloat16").torch_dtype() is torch.bfloat16
    assert RuntimeConfig().torch_dtype() is torch.float32


# ------------------------------------------------------------------------------------------------------------------
# Round trip
# ------------------------------------------------------------------------------------------------------------------


def _non_default() -> XfuseConfig:
    return config_from_dict(
        {
            "model": "/models/HunyuanDiT-v1.2-Diffusers",
            "parallel": {
                "pipefusion_degree": 3,
                "num_patches": 6,
                "warmup_steps": 2,
                "cfg_degree": 2,
                "placement": "linear",
                "stage_split": [14, 13, 13],
            },
            "comm": {"backend": "nccl", "timeout_s": 12.5, "max_inflight": 4, "socket_ifname": "eth0"},
            "runtime": {"device": "cuda", "dtype": "bfloat16"},
            "generation": {
                "prompt": "a cat: 'quoted' \"text\"",
                "negative_prompt": "blurry",
                "height": 864,
                "width": 1024,
                "num_inference_steps": 30,
                "guidance_scale": 6,
                "seed": 1234,
            },
        }
    )


@pytest.mark.parametrize("config", [XfuseConfig(), _non_default()], ids=["defaults", "non_default"])
def test_yaml_round_trip(tmp_path, config):
    d = config.to_dict()
    assert isinstance(d["parallel"], dict)
    if d["parallel"]["stage_split"] is not None:
        assert isinstance(d["parallel"]["stage_split"], list)
    assert config_from_dict(d) == config
    path = _write(tmp_path, yaml.safe_dump(d, sort_keys=False))
    assert load_config(path) == config
    assert load_config(_write(tmp_path, config.to_yaml(), "b.yaml")) == config
    # to_dict is plain data: safe_dump would raise on tuples or dataclasses
    assert yaml.safe_load(yaml.safe_dump(d)) == d


def test_empty_yaml_file_means_defaults(tmp_path):
    assert load_config(_write(tmp_path, "# nothing here\n")) == XfuseConfig()
    assert load_config(_write(tmp_path, "parallel:\n", "b.yaml")) == XfuseConfig()  # empty section


def test_yaml_exponent_float(tmp_path):
    # PyYAML's YAML 1.1 rules read 1e3 as a string; the loader reads it as a float.
    assert load_config(_write(tmp_path, "comm:\n  timeout_s: 1e3\n")).comm.timeout_s == 1000.0


# ------------------------------------------------------------------------------------------------------------------
# Overrides
# ------------------------------------------------------------------------------------------------------------------


def test_parse_override_values():
    assert parse_override("parallel.warmup_steps=2") == ("parallel.warmup_steps", 2)
    assert parse_override("parallel.stage_split=[3,5]") == ("parallel.stage_split", [3, 5])
    assert parse_override("parallel.num_patches=null") == ("parallel.num_patches", None)
    assert parse_override("runtime.dtype=bfloat16") == ("runtime.dtype", "bfloat16")
    assert parse_override("comm.timeout_s=2.5") == ("comm.timeout_s", 2.5)
    assert parse_override("generation.prompt=a=b c") == ("generation.prompt", "a=b c")  # split on first '='
    assert parse_override("model=./weights") == ("model", "./weights")


def test_overrides_apply_on_file(tmp_path):
    path = _write(tmp_path, "parallel:\n  pipefusion_degree: 2\n  num_patches: 4\nruntime:\n  dtype: float16\n")
    c = load_config(
        path,
        [
            "parallel.warmup_steps=2",
            "parallel.stage_split=[3,5]",
            "parallel.num_patches=null",
            "runtime.dtype=bfloat16",
            "generation.height=512",
            "comm.socket_ifname=lo",
            "model=small",
        ],
    )
    assert c.parallel.pipefusion_degree == 2  # kept from the file
    assert c.parallel.warmup_steps == 2
    assert c.parallel.stage_split == (3, 5)
    assert c.parallel.num_patches is None and c.parallel.resolved_num_patches == 2
    assert c.runtime.dtype == "bfloat16"
    assert c.generation.height == 512
    assert c.comm.socket_ifname == "lo"
    assert c.model == "small"


def test_overrides_without_file_and_later_wins():
    c = load_config(None, ["parallel.pipefusion_degree=2", "parallel.pipefusion_degree=4"])
    assert c.parallel.pipefusion_degree == 4
    c = load_config(overrides=["parallel.pipefusion_degree=2", "parallel.num_patches=3"])
    assert c.parallel.resolved_num_patches == 3


def test_overrides_are_validated():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["parallel.warmup_steps=-1"])
    assert e.value.key == "parallel.warmup_steps"


# ------------------------------------------------------------------------------------------------------------------
# parallel_config / comm_config inputs
# ------------------------------------------------------------------------------------------------------------------


def test_parallel_config_inputs():
    dc = ParallelConfig(pipefusion_degree=2, num_patches=4)
    assert parallel_config(dc) is dc
    assert parallel_config({"pipefusion_degree": 2, "num_patches": 4}) == dc
    assert parallel_config(None) == ParallelConfig()
    assert parallel_config({}) == ParallelConfig()
    assert XfuseConfig(parallel=dc).parallel is dc  # a section object is taken as it is
    assert ParallelConfig.model_validate({"pipefusion_degree": 2, "num_patches": 4}) == dc
    with pytest.raises(ConfigError) as e:
        parallel_config({"pipefusion_degre": 2})
    assert e.value.key == "parallel.pipefusion_degre" and "pipefusion_degree" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parallel_config(2)
    assert e.value.key == "parallel"


def test_comm_config_inputs():
    dc = CommConfig(backend="gloo", timeout_s=5)
    assert comm_config(dc) is dc
    assert comm_config({"backend": "gloo", "timeout_s": 5}) == dc
    assert comm_config(None) == CommConfig()
    with pytest.raises(ConfigError) as e:
        comm_config({"backend": "mpi"})
    assert e.value.key == "comm.backend"
    assert cache_config({"method": "taylor"}) == CacheConfig(method="taylor") and cache_config(None) == CacheConfig()


def test_xfuse_config_accepts_section_dicts():
    c = XfuseConfig(parallel={"pipefusion_degree": 2}, comm={"backend": "gloo"})
    assert isinstance(c.parallel, ParallelConfig) and c.parallel.pipefusion_degree == 2
    assert isinstance(c.comm, CommConfig) and c.comm.backend == "gloo"


# ------------------------------------------------------------------------------------------------------------------
# Bad configs (table-driven). Each: (id, raw dict or overrides, expected key, fragments the message must contain)
# ------------------------------------------------------------------------------------------------------------------

# Files that exist: a picture, and a folder with a config.json (build.check_files checks only that a ControlNet folder
# has one)
IMAGE = str(REPO / "docs" / "shapes.png")
CONFIG_FOLDER = str(REPO / "xfuse" / "assets" / "shapes" / "transformer")

BAD_DICTS = [
    ("unknown_section", {"paralel": {}}, "paralel", ["unknown section", "'parallel'", "generation"]),
    ("flat_key_at_top", {"pipefusion_degree": 2}, "pipefusion_degree", ["parallel.pipefusion_degree"]),
    (
        "unknown_key",
        {"parallel": {"pipefusion_degre": 2}},
        "parallel.pipefusion_degre",
        ["did you mean 'parallel.pipefusion_degree'", "num_patches"],
    ),
    ("key_in_wrong_section", {"parallel": {"backend": "gloo"}}, "parallel.backend", ["comm.backend"]),
    ("section_not_mapping", {"parallel": 3}, "parallel", ["mapping", "pipefusion_degree"]),
    ("degree_zero", {"parallel": {"pipefusion_degree": 0}}, "parallel.pipefusion_degree", ["from 1 to 8", "(got 0)"]),
    ("degree_nine", {"parallel": {"pipefusion_degree": 9}}, "parallel.pipefusion_degree", ["from 1 to 8", "(got 9)"]),
    (
        "degree_bool",
        {"parallel": {"pipefusion_degree": True}},
        "parallel.pipefusion_degree",
        ["from 1 to 8", "boolean"],
    ),
    (
        "degree_string",
        {"parallel": {"pipefusion_degree": "2"}},
        "parallel.pipefusion_degree",
        ["from 1 to 8", "string", "(got '2')"],
    ),
    ("degree_float", {"parallel": {"pipefusion_degree": 2.0}}, "parallel.pipefusion_degree", ["from 1 to 8"]),
    ("num_patches_zero", {"parallel": {"num_patches": 0}}, "parallel.num_patches", [">= 1 or null", "(got 0)"]),
    ("warmup_negative", {"parallel": {"warmup_steps": -1}}, "parallel.warmup_steps", [">= 0", "(got -1)"]),
    (
        "warmup_more_than_steps",
        {"parallel": {"warmup_steps": 5}, "generation": {"num_inference_steps": 4}},
        "parallel.warmup_steps",
        ["generation.num_inference_steps", "(got 5)"],
    ),
    ("cfg_degree_three", {"parallel": {"cfg_degree": 3}}, "parallel.cfg_degree", ["must be 1 or 2", "(got 3)"]),
    ("cfg_degree_true", {"parallel": {"cfg_degree": True}}, "parallel.cfg_degree", ["must be 1 or 2"]),
    (
        "cfg2_without_guidance",
        {"parallel": {"cfg_degree": 2}, "generation": {"guidance_scale": 1.0}},
        "parallel.cfg_degree",
        ["guidance_scale > 1"],
    ),
    (
        "placement",
        {"parallel": {"placement": "Folded"}},
        "parallel.placement",
        ["'balanced', 'folded', 'linear'", "did you mean 'folded'"],
    ),
    (
        "stage_split_wrong_length",
        {"parallel": {"pipefusion_degree": 2, "stage_split": [2, 2, 2]}},
        "parallel.stage_split",
        ["one per PipeFusion rank", "3 entries"],
    ),
    (
        "stage_split_zero_entry",
        {"parallel": {"pipefusion_degree": 2, "stage_split": [4, 0]}},
        "parallel.stage_split",
        ["positive", "entry 1"],
    ),
    (
        "stage_split_not_list",
        {"parallel": {"pipefusion_degree": 2, "stage_split": "4,4"}},
        "parallel.stage_split",
        ["list of positive block counts"],
    ),
    ("backend", {"comm": {"backend": "mpi"}}, "comm.backend", ["'auto', 'nccl', 'gloo'", "(got 'mpi')"]),
    ("wait", {"comm": {"wait": "polling"}}, "comm.wait", ["'auto', 'stream', 'host'", "(got 'polling')"]),
    (
        "nccl_on_cpu",
        {"comm": {"backend": "nccl"}, "runtime": {"device": "cpu"}},
        "comm.backend",
        ["gloo", "runtime.device"],
    ),
    ("timeout_zero", {"comm": {"timeout_s": 0}}, "comm.timeout_s", ["> 0.0", "(got 0.0)"]),
    ("timeout_string", {"comm": {"timeout_s": "60"}}, "comm.timeout_s", ["> 0.0", "string"]),
    ("timeout_inf", {"comm": {"timeout_s": float("inf")}}, "comm.timeout_s", ["finite"]),
    ("max_inflight_zero", {"comm": {"max_inflight": 0}}, "comm.max_inflight", [">= 1", "(got 0)"]),
    ("socket_ifname_int", {"comm": {"socket_ifname": 0}}, "comm.socket_ifname", ["string or null"]),
    (
        "host_timeout_zero",
        {"comm": {"host_timeout_s": 0}},
        "comm.host_timeout_s",
        ["'auto', 'off' or a finite number of seconds > 0", "(got 0.0)"],
    ),
    (
        "host_timeout_word",
        {"comm": {"host_timeout_s": "never"}},
        "comm.host_timeout_s",
        ["'auto', 'off'", "(got 'never')"],
    ),
    (
        "device",
        {"runtime": {"device": "gpu"}},
        "runtime.device",
        ["'auto', 'cpu', 'cuda'", "did you mean 'cuda'", "(got 'gpu')"],
    ),
    (
        "dtype",
        {"runtime": {"dtype": "bf16"}},
        "runtime.dtype",
        ["'float32', 'bfloat16', 'float16'", "did you mean 'bfloat16'"],
    ),
    ("prompt_not_string", {"generation": {"prompt": 42}}, "generation.prompt", ["string", "(got 42)"]),
    ("height_negative", {"generation": {"height": -8}}, "generation.height", [">= 1 or null", "(got -8)"]),
    ("width_string", {"generation": {"width": "1024"}}, "generation.width", ["integer", "string"]),
    ("steps_zero", {"generation": {"num_inference_steps": 0}}, "generation.num_inference_steps", [">= 1"]),
    ("guidance_negative", {"generation": {"guidance_scale": -1}}, "generation.guidance_scale", [">= 0.0"]),
    ("seed_negative", {"generation": {"seed": -1}}, "generation.seed", ["from 0 to", "(got -1)"]),
    ("num_frames_zero", {"generation": {"num_frames": 0}}, "generation.num_frames", [">= 1 or null", "(got 0)"]),
    ("num_frames_string", {"generation": {"num_frames": "9"}}, "generation.num_frames", ["integer", "string"]),
    ("fps_zero", {"generation": {"fps": 0}}, "generation.fps", [">= 1", "(got 0)"]),
    ("image_empty", {"generation": {"image": ""}}, "generation.image", ["non-empty string or null", "(got '')"]),
    ("fps_null", {"generation": {"fps": None}}, "generation.fps", ["not null"]),
    (
        "controlnet_without_control_image",
        {"generation": {"controlnet": CONFIG_FOLDER}},
        "generation.control_image",
        ["needed with generation.controlnet"],
    ),
    (
        "control_image_without_controlnet",
        {"generation": {"control_image": IMAGE}},
        "generation.controlnet",
        ["needed with generation.control_image"],
    ),
    (
        "controlnet_with_image_to_video",
        {"generation": {"controlnet": CONFIG_FOLDER, "control_image": IMAGE, "image": IMAGE}},
        "generation.controlnet",
        ["generation.image"],
    ),
    (
        "control_window_empty",
        {"generation": {"control_guidance_start": 0.5, "control_guidance_end": 0.5}},
        "generation.control_guidance_start",
        ["below generation.control_guidance_end", "0.5 >= 0.5"],
    ),
    (
        "control_scale_negative",
        {"generation": {"controlnet_conditioning_scale": -1}},
        "generation.controlnet_conditioning_scale",
        [">= 0.0", "(got -1.0)"],
    ),
    ("control_end_past_1", {"generation": {"control_guidance_end": 1.5}}, "generation.control_guidance_end", ["1.0"]),
    ("fps_float", {"generation": {"fps": 23.976}}, "generation.fps", ["integer", "(got 23.976)"]),
    ("serve_port_too_big", {"serve": {"port": 70000}}, "serve.port", ["from 0 to 65535", "(got 70000)"]),
    ("serve_host_empty", {"serve": {"host": ""}}, "serve.host", ["non-empty string"]),
    ("serve_max_queue_zero", {"serve": {"max_queue": 0}}, "serve.max_queue", [">= 1", "(got 0)"]),
    ("serve_unknown_key", {"serve": {"batch_size": 4}}, "serve.batch_size", ["unknown key", "max_queue"]),
    (
        "serve_heartbeat_slow",
        {"serve": {"heartbeat_interval_s": 5}},
        "serve.heartbeat_interval_s",
        ["at most 1.0 s", "(got 5.0)"],
    ),
    (
        "serve_heartbeat_beyond_comm_timeout",
        {"serve": {"heartbeat_interval_s": 1.0}, "comm": {"timeout_s": 0.5}},
        "serve.heartbeat_interval_s",
        ["below comm.timeout_s (0.5 s)"],
    ),
    (
        "serve_streams_with_ulysses",
        {"serve": {"max_inflight": 2}, "parallel": {"ulysses_degree": 2}},
        "serve.max_inflight",
        ["only with parallel.ulysses_degree 1", "use 1, or parallel.ulysses_degree 1 (got 2)"],
    ),
    (
        "serve_streams_with_compile",
        {"serve": {"max_inflight": 4}, "compile": {"mode": "regional"}},
        "serve.max_inflight",
        ["only with compile.mode off", "(got 4)"],
    ),
    (
        "compile_graphs_with_ulysses",
        {"compile": {"mode": "graphs"}, "parallel": {"ulysses_degree": 2}},
        "compile.mode",
        [
            "graphs captures whole stage passes",
            "parallel.ulysses_degree 2, parallel.ring_degree 1",
            "use off or regional with sequence parallelism",
            "(got 'graphs')",
        ],
    ),
    (
        "compile_captured_inductor_with_ring",
        {"compile": {"mode": "regional+graphs"}, "parallel": {"ring_degree": 2}},
        "compile.mode",
        ["regional+graphs captures whole stage passes", "(got 'regional+graphs')"],
    ),
    (
        "compile_captured_inductor_other_backend",
        {"compile": {"mode": "regional+graphs", "backend": "aot_eager"}},
        "compile.backend",
        ["must be 'inductor' with compile.mode regional+graphs", "(got 'aot_eager')"],
    ),
    (
        "compile_mode_unknown",
        {"compile": {"mode": "cudagraphs"}},
        "compile.mode",
        ["'off', 'regional', 'graphs', 'regional+graphs'", "(got 'cudagraphs')"],
    ),
    (
        "vae_parallel_unknown",
        {"parallel": {"vae_parallel": "always"}},
        "parallel.vae_parallel",
        ["'auto', 'on', 'off'", "(got 'always')"],
    ),
    (
        "vae_parallel_int",
        {"parallel": {"vae_parallel": 1}},
        "parallel.vae_parallel",
        ["'auto', 'on', 'off'", "(got 1)"],
    ),
    (
        "text_encoder_unknown",
        {"parallel": {"text_encoder": "gpu1"}},
        "parallel.text_encoder",
        ["'auto', 'rank0', 'split', 'offload'", "(got 'gpu1')"],
    ),
    ("serve_timeout_zero", {"serve": {"request_timeout_s": 0}}, "serve.request_timeout_s", ["> 0.0"]),
    ("serve_model_name_int", {"serve": {"model_name": 3}}, "serve.model_name", ["string or null"]),
    ("model_empty", {"model": ""}, "model", ["non-empty string"]),
    ("model_not_string", {"model": 7}, "model", ["string", "(got 7)"]),
    ("top_level_not_mapping", [1, 2], "config", ["mapping", "parallel"]),
]


@pytest.mark.parametrize("raw,key,fragments", [c[1:] for c in BAD_DICTS], ids=[c[0] for c in BAD_DICTS])
def test_bad_config(raw, key, fragments):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    err = e.value
    assert isinstance(err, ValueError)
    assert err.key == key
    msg = str(err)
    assert msg.startswith(f"{key}: ")
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


# Files a config names: it reads none of them (pure); build.check_files refuses a missing one, naming its key, where
# generate and serve start (every rank, before any communication).
MISSING_FILES = [
    ("image_missing", {"generation": {"image": "no/such.png"}}, "generation.image", ["not found: 'no/such.png'"]),
    (
        "controlnet_missing",
        {"generation": {"controlnet": "no/such", "control_image": IMAGE}},
        "generation.controlnet",
        ["diffusers ControlNet folder", "'no/such'"],
    ),
    (
        "control_image_missing",
        {"generation": {"controlnet": CONFIG_FOLDER, "control_image": "no/such.png"}},
        "generation.control_image",
        ["not found: 'no/such.png'"],
    ),
    ("lora_missing", {"generation": {"lora": {"no/such": 1.0}}}, "generation.lora", ["no LoRA file", "'no/such'"]),
    (
        "adapter_missing",
        {"serve": {"lora_adapters": {"a": "no/such"}}},
        "serve.lora_adapters.a",
        ["no LoRA file", "'no/such'"],
    ),
]


@pytest.mark.parametrize("raw,key,fragments", [c[1:] for c in MISSING_FILES], ids=[c[0] for c in MISSING_FILES])
def test_missing_files_are_refused_where_they_are_opened(raw, key, fragments):
    config = config_from_dict(raw)  # the config reads no file
    with pytest.raises(ConfigError) as e:
        check_files(config)
    assert e.value.key == key
    for fragment in fragments:
        assert fragment in str(e.value), f"{fragment!r} not in {str(e.value)!r}"


def test_files_that_exist_pass():
    check_files(config_from_dict({"generation": {"controlnet": CONFIG_FOLDER, "control_image": IMAGE}}))
    check_files(config_from_dict({"generation": {"lora": {IMAGE: 0.5}}, "serve": {"lora_adapters": {"a": IMAGE}}}))
    check_files(XfuseConfig(generation=None, serve=None))


BAD_OVERRIDES = [
    ("no_equals", ["parallel.warmup_steps"], "--set", ["KEY=VALUE", "'parallel.warmup_steps'"]),
    ("empty_key", ["=2"], "--set", ["KEY=VALUE"]),
    ("unknown_key", ["parallel.num_patch=2"], "parallel.num_patch", ["did you mean 'parallel.num_patches'"]),
    ("unknown_section", ["paralel.num_patches=2"], "paralel", ["unknown section", "'parallel'"]),
    ("whole_section", ["parallel=3"], "parallel", ["is a section", "parallel.pipefusion_degree="]),
    ("too_deep", ["parallel.stage_split.0=3"], "parallel.stage_split.0", ["SECTION.KEY"]),
    ("model_subkey", ["model.path=x"], "model", ["model=VALUE"]),
    ("bad_yaml", ["generation.prompt=[unclosed"], "generation.prompt", ["not valid YAML"]),
    ("value_type", ["parallel.pipefusion_degree=two"], "parallel.pipefusion_degree", ["from 1 to 8"]),
    ("quoted_int", ["parallel.pipefusion_degree='2'"], "parallel.pipefusion_degree", ["string"]),
]


@pytest.mark.parametrize("overrides,key,fragments", [c[1:] for c in BAD_OVERRIDES], ids=[c[0] for c in BAD_OVERRIDES])
def test_bad_override(overrides, key, fragments):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key
    for fragment in fragments:
        assert fragment in str(e.value), f"{fragment!r} not in {str(e.value)!r}"


def test_bad_files(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert e.value.key == missing and "not found" in str(e.value)

    path = _write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == path and "mapping" in str(e.value) and "parallel" in str(e.value)

    path = _write(tmp_path, "parallel: [unclosed\n", "bad.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == path and "YAML" in str(e.value)

    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path))
    assert e.value.key == str(tmp_path)

    path = _write(tmp_path, "parallel:\n  num_patchs: 4\n", "typo.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == "parallel.num_patchs" and "parallel.num_patches" in str(e.value)


def test_direct_construction_validates():
    with pytest.raises(ConfigError) as e:
        ParallelConfig(cfg_degree=3)
    assert e.value.key == "parallel.cfg_degree" and "must be 1 or 2" in str(e.value) and "(got 3)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        RuntimeConfig(dtype="float64")
    assert e.value.key == "runtime.dtype"


# ------------------------------------------------------------------------------------------------------------------
# check_world
# ------------------------------------------------------------------------------------------------------------------

HUNYUAN = dict(spec=HUNYUANDIT, num_blocks=40, patch_size=2, height=1024, width=1024, num_heads=16)


def check_world(config: XfuseConfig, *, world_size, spec, num_blocks, patch_size, height, width, num_heads) -> None:
    """The checks a launch makes before any communication: the world size (``xfuse.runtime.world``), then the
    family's checks of the model and the image (``ModelSpec.check_layout``)."""
    check_world_size(config.parallel, world_size)
    spec.check_layout(config.parallel, num_blocks=num_blocks, patch_size=patch_size, height=height, width=width,
                      num_heads=num_heads)  # fmt: skip


def _cfg(**parallel) -> XfuseConfig:
    return XfuseConfig(parallel=parallel)


def test_check_world_ok():
    for n in range(1, 9):
        check_world(_cfg(pipefusion_degree=n), world_size=n, **HUNYUAN)
        check_world(_cfg(pipefusion_degree=n, placement="linear"), world_size=n, **HUNYUAN)
        check_world(_cfg(pipefusion_degree=n, placement="balanced"), world_size=n, **HUNYUAN)
    check_world(_cfg(pipefusion_degree=4, cfg_degree=2), world_size=8, **HUNYUAN)
    # uneven bands (864 px -> 54 token rows) and uneven folded chunks are fine
    check_world(_cfg(pipefusion_degree=4), world_size=4, **{**HUNYUAN, "height": 864})
    check_world(_cfg(pipefusion_degree=3, placement="folded", stage_split=[6, 7, 7]), world_size=3, **HUNYUAN)
    check_world(_cfg(pipefusion_degree=3, placement="balanced", stage_split=[12, 14, 14]), world_size=3, **HUNYUAN)
    check_world(_cfg(pipefusion_degree=3, placement="balanced"), world_size=3, **{**HUNYUAN, "num_blocks": 6})
    check_world(_cfg(pipefusion_degree=2, num_patches=64), world_size=2, **HUNYUAN)
    # sequence parallelism: world = cfg x pipefusion x ulysses x ring, uneven token chunks allowed
    check_world(_cfg(pipefusion_degree=2, ulysses_degree=2, ring_degree=2), world_size=8, **HUNYUAN)
    check_world(_cfg(cfg_degree=2, ring_degree=3), world_size=6, **HUNYUAN)
    check_world(_cfg(ulysses_degree=16), world_size=16, **{**HUNYUAN, "height": 80, "width": 64})  # 20 tokens: 2 or 1


CHECK_WORLD_BAD = [
    (
        "world_mismatch",
        dict(pipefusion_degree=2),
        dict(world_size=4),
        "parallel.pipefusion_degree",
        ["parallel.cfg_degree", "world size (4)", "--nproc_per_node=2", "pipefusion_degree=4"],
    ),
    (
        "world_mismatch_cfg",
        dict(pipefusion_degree=4, cfg_degree=2),
        dict(world_size=4),
        "parallel.pipefusion_degree",
        ["= 8 ranks", "--nproc_per_node=8"],
    ),
    (
        "bad_height",
        dict(pipefusion_degree=2),
        dict(world_size=2, height=1000),
        "generation.height",
        ["multiple of 16", "992", "(got 1000)"],
    ),
    ("bad_width", dict(pipefusion_degree=2), dict(world_size=2, width=1032), "generation.width", ["multiple of 16"]),
    ("odd_layers", dict(pipefusion_degree=2), dict(world_size=2, num_blocks=39), "model", ["even", "skip"]),
    (
        "num_patches_too_large",
        dict(pipefusion_degree=2, num_patches=65),
        dict(world_size=2),
        "parallel.num_patches",
        ["64", "(got 65)"],
    ),
    (
        "num_patches_small_image",
        dict(pipefusion_degree=2, num_patches=9),
        dict(world_size=2, height=128, width=128),
        "parallel.num_patches",
        ["8"],
    ),
    (
        "folded_degree_too_large",
        dict(pipefusion_degree=8, placement="folded"),
        dict(world_size=8, num_blocks=8),
        "parallel.pipefusion_degree",
        ["folded"],
    ),
    (
        "linear_degree_too_large",
        dict(pipefusion_degree=8, placement="linear"),
        dict(world_size=8, num_blocks=6),
        "parallel.pipefusion_degree",
        ["linear"],
    ),
    (
        "stage_split_bad_sum_folded",
        dict(pipefusion_degree=2, stage_split=[10, 20]),
        dict(world_size=2),
        "parallel.stage_split",
        ["20"],
    ),
    (
        "balanced_degree_too_large",
        dict(pipefusion_degree=4, placement="balanced"),
        dict(world_size=4, num_blocks=6),
        "parallel.pipefusion_degree",
        ["from 1 to 3", "6-block model with balanced placement", "2 blocks per rank", "(got 4)"],
    ),
    (
        "stage_split_bad_sum_balanced",
        dict(pipefusion_degree=2, placement="balanced", stage_split=[10, 10]),
        dict(world_size=2),
        "parallel.stage_split",
        ["at least 2", "summing to 40", "(got [10, 10])"],
    ),
    (
        "stage_split_one_block_balanced",
        dict(pipefusion_degree=2, placement="balanced", stage_split=[39, 1]),
        dict(world_size=2),
        "parallel.stage_split",
        ["2 block counts of at least 2", "a chunk each way"],
    ),
    (
        "ulysses_above_the_heads",  # a degree need not divide the heads (uneven groups), but gives each one at least
        dict(ulysses_degree=4),
        dict(world_size=4, num_heads=2),
        "parallel.ulysses_degree",
        ["at most the model's 2 attention heads", "parallel.ring_degree", "(got 4)"],
    ),
    (
        "sequence_world_mismatch",
        dict(ulysses_degree=2, ring_degree=2),
        dict(world_size=2),
        "parallel.pipefusion_degree",
        ["parallel.ulysses_degree (2) x parallel.ring_degree (2) = 4 ranks", "world size (2)", "--nproc_per_node=4"],
    ),
    (
        "sequence_chunks_too_small",
        dict(ulysses_degree=16),
        dict(world_size=16, height=64, width=32),
        "parallel.ulysses_degree",
        ["= 16 ranks share", "4x2-token image has 8", "fewer sequence-parallel ranks"],
    ),
    (
        "stage_split_bad_sum_linear",
        dict(pipefusion_degree=2, placement="linear", stage_split=[10, 10]),
        dict(world_size=2),
        "parallel.stage_split",
        ["40"],
    ),
]


@pytest.mark.parametrize(
    "parallel,world,key,fragments", [c[1:] for c in CHECK_WORLD_BAD], ids=[c[0] for c in CHECK_WORLD_BAD]
)
def test_check_world_bad(parallel, world, key, fragments):
    kwargs = {**HUNYUAN, **world}
    with pytest.raises(ConfigError) as e:
        check_world(_cfg(**parallel), **kwargs)
    assert e.value.key == key
    for fragment in fragments:
        assert fragment in str(e.value), f"{fragment!r} not in {str(e.value)!r}"


# ------------------------------------------------------------------------------------------------------------------
# Shipped YAML files
# ------------------------------------------------------------------------------------------------------------------


def test_config_files_exist():
    names = {str(p.relative_to(REPO / "configs")) for p in CONFIG_FILES}
    expected = {"tiny/pp2.yaml", "hunyuandit/cfg2_pp4.yaml"} | {f"hunyuandit/pp{n}.yaml" for n in range(2, 9)}
    assert expected <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[str(p.relative_to(REPO)) for p in CONFIG_FILES])
def test_config_file_loads(path):
    c = load_config(str(path))
    assert c.to_dict() == config_from_dict(c.to_dict()).to_dict()
    if path.parent.name == "hunyuandit":
        # the released HunyuanDiT: 40 blocks, patch size 2, 1024 px
        assert c.generation.height == c.generation.width == 1024
        check_world(
            c,
            world_size=c.world_size,
            spec=HUNYUANDIT,
            num_blocks=40,
            patch_size=2,
            height=c.generation.height,
            width=c.generation.width,
            num_heads=16,
        )


def test_tiny_demo_config():
    c = load_config(str(REPO / "configs/tiny/pp2.yaml"))
    assert c.model == "tiny"
    p = c.parallel
    assert (p.pipefusion_degree, p.num_patches, p.warmup_steps, p.placement) == (2, 2, 1, "folded")
    g = c.generation
    assert (g.height, g.width, g.num_inference_steps, g.seed) == (256, 256, 8, 0)
    assert g.prompt


def test_wan_demo_config():
    c = load_config(str(REPO / "configs/wan/pp2.yaml"))
    assert c.model == "wan-tiny" and c.world_size == 2
    p, g = c.parallel, c.generation
    assert (p.pipefusion_degree, p.num_patches, p.warmup_steps, p.video_patches) == (2, 2, 1, "temporal")
    assert (g.height, g.width, g.num_frames, g.fps, g.num_inference_steps) == (128, 224, 9, 16, 8)


def test_default_video_size_and_the_video_call(tmp_path):
    """A video model's clip: the preset's own size (height, width, frames in its presets module), the request's keys
    over it, WanPipeline's defaults for a folder's model; num_frames the VAE cannot take is refused naming its key."""
    from xfuse.build import default_video_size, image_call_kwargs, video_call_kwargs
    from xfuse.families.registry import model_spec, resolve

    def default_video_size_of(config):
        return default_video_size(config, resolve(config.model))

    from xfuse.families.wan.presets import DEFAULT_SIZE

    assert DEFAULT_SIZE["wan-tiny"] == (128, 224, 9)
    assert default_video_size_of(XfuseConfig(model="wan-tiny")) == (224, 128, 9)  # (width, height, num_frames)
    asked = config_from_dict({"model": "wan-tiny", "generation": {"width": 96, "num_frames": 17}})
    assert default_video_size_of(asked) == (96, 128, 17)
    assert default_video_size_of(XfuseConfig(model="wan2.1-t2v-1.3b")) == (832, 480, 81)
    folder = model_spec("wan-tiny").save_preset_pipeline(tmp_path / "wan", "wan-tiny")
    assert default_video_size_of(XfuseConfig(model=str(folder))) == (832, 480, 81)  # WanPipeline.__call__'s defaults
    assert default_video_size_of(XfuseConfig(model="wan-tiny", generation=None)) == (224, 128, 9)
    with pytest.raises(ConfigError) as e:
        default_video_size_of(config_from_dict({"model": "wan-tiny", "generation": {"num_frames": 8}}))
    assert e.value.key == "generation.num_frames" and "4k + 1" in str(e.value) and "e.g. 5 or 9 (got 8)" in str(e.value)
    with pytest.raises(ValueError, match="image model"):
        default_video_size_of(XfuseConfig(model="tiny"))
    request = dict(prompt="p", negative_prompt=None, width=96, height=64, num_inference_steps=2, guidance_scale=5.0,
                   seed=3)  # fmt: skip
    wan, tiny = model_spec("wan-tiny"), model_spec("tiny")
    call = video_call_kwargs(**request, num_frames=9, spec=wan)
    assert (call["num_frames"], call["num_videos_per_prompt"], call["output_type"]) == (9, 1, "pil")
    assert "num_images_per_prompt" not in call and "negative_prompt" not in call
    assert call["generator"].initial_seed() == 3
    image = image_call_kwargs(**request, spec=tiny)
    assert image["num_images_per_prompt"] == 1 and "num_frames" not in image and "output_type" not in image
    assert image["use_resolution_binning"] is False  # HunyuanDiT bins sizes: off, as before
    with pytest.raises(ValueError, match="image_call_kwargs"):
        video_call_kwargs(**request, num_frames=9, spec=tiny)
    first = object()  # image-to-video: the first frame, passed as given
    assert video_call_kwargs(**request, num_frames=9, image=first, spec=wan)["image"] is first


def test_the_vae_factor_is_the_models_own_where_the_family_reads_it_from_its_vae(tmp_path):
    """Wan 2.2 TI2V's VAE is 16 px per latent pixel (AutoencoderKLWan's scale_factor_spatial), Wan 2.1's 8: a model's
    spec carries its own (from a preset's VAE config or a folder's vae/config.json); other families keep theirs."""
    from xfuse.build import _pipeline_class
    from xfuse.families.registry import model_spec, resolve
    from xfuse.families.wan.spec import WAN

    assert model_spec("wan2.2-ti2v-5b").vae_scale_factor == model_spec("wan2.2-ti2v-tiny").latent_scale == 16
    assert model_spec("wan-tiny") is WAN and model_spec("wan2.2-t2v-a14b") is WAN and WAN.vae_scale_factor == 8
    assert WAN.for_vae(None) is WAN and WAN.for_vae({"scale_factor_spatial": 8}) is WAN
    assert model_spec("flux-tiny").for_vae({"scale_factor_spatial": 16}).vae_scale_factor == 8  # not read there
    folder = WAN.save_preset_pipeline(tmp_path / "ti2v", "wan2.2-ti2v-tiny")
    assert model_spec(str(folder)).vae_scale_factor == 16
    with pytest.raises(ConfigError, match="multiple of 32 pixels .VAE factor 16 x patch size 2.") as e:
        model_spec(str(folder)).check_layout(
            ParallelConfig(), num_blocks=4, patch_size=2, height=112, width=224, latent_frames=3
        )
    assert e.value.key == "generation.height"
    image = tmp_path / "first.png"
    image.write_bytes(b"")  # the file's existence is build.check_files' check; reading it is the CLI's
    config = config_from_dict({"model": "wan2.2-ti2v-tiny", "generation": {"image": str(image)}})
    ti2v = resolve("wan2.2-ti2v-tiny")
    assert _pipeline_class(config, ti2v).__name__ == "PipeFusionWanImageToVideoPipeline"
    assert _pipeline_class(XfuseConfig(model="wan2.2-ti2v-tiny"), ti2v).__name__ == "PipeFusionWanPipeline"


def test_hunyuandit_sweep_configs():
    for n in range(2, 9):
        c = load_config(str(REPO / f"configs/hunyuandit/pp{n}.yaml"))
        assert c.parallel.pipefusion_degree == n and c.parallel.resolved_num_patches == n
        assert c.world_size == n and c.runtime.dtype == "bfloat16" and c.generation.num_inference_steps == 50
    c = load_config(str(REPO / "configs/hunyuandit/cfg2_pp4.yaml"))
    assert (c.parallel.cfg_degree, c.parallel.pipefusion_degree, c.world_size) == (2, 4, 8)


@pytest.mark.parametrize(
    "wait,device,stream_ordered",
    [("auto", "cuda", True), ("auto", "cpu", False), ("stream", "cpu", True), ("host", "cuda", False)],
)
def test_comm_wait_resolves_per_device(wait, device, stream_ordered):
    assert CommConfig(wait=wait).stream_ordered(device) is stream_ordered


@pytest.mark.parametrize(
    "host_timeout_s,timeout_s,device,resolved",
    [
        ("auto", 60.0, "cuda", 120.0),  # twice the comm timeout: a task's wait for a message, and its launches
        ("auto", 60.0, "cpu", None),  # the CPU host computes each task: no bound on a large model's
        ("off", 60.0, "cuda", None),
        (5.0, 60.0, "cpu", 5.0),  # set: on any device (the failure drills run it on CPU)
        (300.0, 10.0, "cuda", 300.0),
    ],
)
def test_comm_host_timeout_resolves_per_device(host_timeout_s, timeout_s, device, resolved):
    comm = CommConfig(host_timeout_s=host_timeout_s, timeout_s=timeout_s)
    assert comm.resolved_host_timeout_s(device) == resolved


# parallel.vae_parallel: (mode, world size, height, width, latent rows, a clip) -> decoded over the world
VAE_PARALLEL = [
    ("auto", 2, 384, 384, 48, False, True),  # from VAE_PARALLEL_MIN_PIXELS on
    ("auto", 2, 384, 376, 48, False, False),  # below it: the messages cost more than the split saves
    ("auto", 2, 96, 96, 12, True, True),  # a clip: from VIDEO_VAE_PARALLEL_MIN_PIXELS per frame on
    ("auto", 2, 96, 88, 11, True, False),
    ("auto", 1, 2048, 2048, 256, False, False),  # one rank: nothing to split
    ("auto", 8, 2048, 48, 6, False, False),  # fewer latent rows than ranks: rank 0 alone
    ("on", 2, 64, 64, 8, False, True),
    ("on", 2, 64, 64, 8, True, True),
    ("on", 1, 64, 64, 8, False, False),
    ("off", 8, 4096, 4096, 512, True, False),
]


@pytest.mark.parametrize("mode,world,height,width,rows,video,parallel", VAE_PARALLEL)
def test_which_calls_decode_over_the_world(mode, world, height, width, rows, video, parallel):
    from xfuse.parallel.vae_decode import decodes_in_parallel, vae_on_every_rank

    config = ParallelConfig(vae_parallel=mode)
    assert decodes_in_parallel(config, world, height, width, rows, video=video) is parallel
    assert vae_on_every_rank(config, world, "AutoencoderKL") is (mode != "off" and world > 1)
    assert vae_on_every_rank(config, world, "AutoencoderKLWan") is (mode != "off" and world > 1)
    # Qwen-Image's 3-D VAE stays on rank 0 whatever the mode; no VAE, nowhere
    assert not vae_on_every_rank(config, world, "AutoencoderKLQwenImage") and not vae_on_every_rank(config, world, None)


def test_vae_parallel_on_needs_a_latent_row_per_rank():
    from xfuse.parallel.vae_decode import decodes_in_parallel

    with pytest.raises(ConfigError) as e:
        decodes_in_parallel(ParallelConfig(vae_parallel="on"), 8, 48, 2048, 6)
    assert e.value.key == "parallel.vae_parallel"
    assert "6 rows for 8 ranks" in str(e.value) and "use auto or off" in str(e.value)


@pytest.mark.parametrize(
    "section,key,written,read",
    [
        ("parallel", "vae_parallel", "on", "on"),
        ("parallel", "vae_parallel", "off", "off"),
        ("parallel", "vae_parallel", "auto", "auto"),
        ("comm", "host_timeout_s", "off", "off"),  # the third GPU run's --set comm.host_timeout_s=off was refused
        ("comm", "host_timeout_s", "auto", "auto"),
        ("cache", "method", "off", "off"),
    ],
)
def test_an_off_switch_as_yaml_reads_as_written(tmp_path, section, key, written, read):
    """YAML 1.1 reads a bare on / off as a boolean; the keys that take ``off`` take it as written."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {written}\n")
    assert getattr(getattr(load_config(str(path)), section), key) == read
    assert getattr(getattr(load_config(None, [f"{section}.{key}={written}"]), section), key) == read


def test_on_is_no_host_timeout():
    with pytest.raises(ConfigError, match=r"comm.host_timeout_s: must be 'auto', 'off' or a finite number"):
        load_config(None, ["comm.host_timeout_s=on"])


@pytest.mark.parametrize(
    "compile_section,timeout_s,longest",
    [
        ({}, 60.0, 60.0),  # compile off: the comm timeout, whatever compile.timeout_s says
        ({"timeout_s": 5000.0}, 60.0, 60.0),
        ({"mode": "regional"}, 60.0, 960.0),  # a compiling request's waits: a peer's compile bound, then a wait's
        ({"mode": "regional", "timeout_s": 30.0}, 60.0, 90.0),
    ],
)
def test_the_longest_wait_is_the_comm_timeout_or_a_compiling_requests(compile_section, timeout_s, longest):
    config = XfuseConfig(compile=compile_section, comm={"timeout_s": timeout_s})
    assert config.longest_wait_s == longest


@pytest.mark.parametrize(
    "sizes,error",
    [
        (["1024x768", "512x512"], None),
        (["1024"], "compile.warmup_sizes"),
        (["0x512"], "compile.warmup_sizes"),
        ("1024x1024", "compile.warmup_sizes"),  # a list, not one size
    ],
)
def test_warmup_sizes_are_width_x_height(sizes, error):
    if error is None:
        assert XfuseConfig(compile={"warmup_sizes": sizes}).compile.warmup == [(1024, 768), (512, 512)]
        return
    with pytest.raises(ConfigError, match=re.escape(error)) as caught:
        XfuseConfig(compile={"warmup_sizes": sizes})
    assert "'WIDTHxHEIGHT'" in str(caught.value)
