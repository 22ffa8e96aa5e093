"""A request's LoRA adapters (``xfuse.serve.protocol``): by name, as a weighted set, or named as the ``model`` (as
vLLM serves LoRA); every refusal names the field. And the ``serve.lora_adapters`` config."""

import dataclasses
import json

import pytest

from xfuse.build import check_files
from xfuse.config import ConfigError, config_from_dict
from xfuse.families.registry import resolve
from xfuse.serve.protocol import RequestError, RequestLimits, parse_request

LIMITS = RequestLimits(
    "sd3-tiny", 64, 64, 4, 5.0, None, 2, 512, 512 * 512, 100, 100, check_size=lambda w, h: None, adapters=("a", "b")
)


@pytest.mark.parametrize(
    "extra,lora",
    [
        ({}, ()),
        ({"lora": "a"}, (("a", 1.0),)),
        ({"lora": {"a": 0.7, "b": 0.4}}, (("a", 0.7), ("b", 0.4))),
        ({"lora": {"b": 2}}, (("b", 2.0),)),  # a JSON integer is a number
        ({"model": "b"}, (("b", 1.0),)),
        ({"model": "sd3-tiny", "lora": "a"}, (("a", 1.0),)),
    ],
)
def test_a_request_picks_its_adapters(extra, lora):
    job = parse_request(json.dumps({"prompt": "a cat", **extra}), LIMITS)
    assert job.lora == lora


@pytest.mark.parametrize(
    "extra,param,says",
    [
        ({"lora": "c"}, "lora", "lora: 'c' is not an adapter of this server; it has 'a', 'b' (GET /v1/models)"),
        ({"lora": {"a": 1.0, "z": 1.0}}, "lora", "'z' is not an adapter"),
        ({"lora": {}}, "lora", "lora must name at least one adapter"),
        ({"lora": ["a"]}, "lora", "lora must be an adapter's name or an object of adapter names to weights"),
        ({"lora": {"a": "1"}}, "lora", "(got {'a': '1'})"),
        ({"model": "a", "lora": "b"}, "lora", "name adapters either as model or in lora, not both"),
        ({"model": "c"}, "model", "model 'c' is not served here"),
    ],
)
def test_a_bad_lora_is_refused_naming_the_field(extra, param, says):
    with pytest.raises(RequestError) as e:
        parse_request(json.dumps({"prompt": "a cat", **extra}), LIMITS)
    assert e.value.status == 400 and e.value.param.startswith(param) and says in e.value.message


def test_a_server_without_adapters_names_none():
    with pytest.raises(RequestError) as e:
        parse_request(json.dumps({"prompt": "a cat", "lora": "a"}), dataclasses.replace(LIMITS, adapters=()))
    assert "it has none (serve.lora_adapters is empty)" in e.value.message


@pytest.mark.parametrize(
    "adapters,key,says",
    [
        ({"a b": "."}, "serve.lora_adapters", "adapter names are 1 to 64 letters"),
        ({"a": ""}, "serve.lora_adapters", "entry 'a': must be a non-empty string"),
        (["a"], "serve.lora_adapters", "a mapping of adapter names to LoRA files or folders"),
        ({"a": "/nowhere/lora"}, "serve.lora_adapters.a", "no LoRA file or folder at '/nowhere/lora'"),
    ],
)
def test_bad_serve_adapters_name_the_key(adapters, key, says):
    with pytest.raises(ConfigError) as e:
        check_files(config_from_dict({"serve": {"lora_adapters": adapters}}))  # the paths: where xfuse serve starts
    assert e.value.key == key and says in str(e.value)


def test_an_adapter_named_as_the_model_is_refused_before_start():
    from xfuse.serve.server import check_adapters

    config = config_from_dict({"model": "sd3-tiny", "serve": {"lora_adapters": {"sd3-tiny": "."}}})
    with pytest.raises(ConfigError) as e:
        check_adapters(config, resolve(config.model))
    assert e.value.key == "serve.lora_adapters" and "has the served model's own name" in str(e.value)


@pytest.mark.parametrize(
    "lora,says",
    [
        ({"/nowhere/lora": 1.0}, "generation.lora: no LoRA file or folder at '/nowhere/lora'"),
        ({".": "strong"}, "entry '.': input should be a valid number"),
    ],
)
def test_bad_generation_lora_names_the_key(lora, says):
    with pytest.raises(ConfigError) as e:
        check_files(config_from_dict({"generation": {"lora": lora}}))  # the paths: where xfuse generate starts
    assert e.value.key == "generation.lora" and says in str(e.value)


def test_generate_only_keys_are_refused_by_serve_before_start():
    """``generation.lora`` and ``generation.controlnet`` are ``xfuse generate``'s: serve refuses them naming the key
    (a served request picks adapters by name and carries no control image)."""
    from tests.support import REPO
    from xfuse.serve.server import check_adapters

    image, folder = str(REPO / "docs" / "shapes.png"), str(REPO / "xfuse" / "assets" / "shapes" / "transformer")
    for generation, key in (({"lora": {".": 1.0}}, "generation.lora"),
                            ({"controlnet": folder, "control_image": image}, "generation.controlnet")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            check_adapters(config_from_dict({"model": "sd3-tiny", "generation": generation}), resolve("sd3-tiny"))
        assert e.value.key == key and "xfuse generate's" in str(e.value)
