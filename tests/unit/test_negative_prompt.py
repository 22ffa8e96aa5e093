"""A negative prompt where the model's pipeline takes none (FLUX.2's: [dev] has no CFG, [klein] guides with the empty
prompt) is refused by name: ``generation.negative_prompt`` in a config, ``negative_prompt`` in an HTTP request."""

import json

import pytest

from xfuse.build import check_negative_prompt, image_call_kwargs, takes_negative_prompt
from xfuse.config import ConfigError
from xfuse.families.registry import FAMILIES, model_spec
from xfuse.serve.protocol import RequestError, RequestLimits, parse_request

REQUEST = dict(prompt="p", width=96, height=64, num_inference_steps=2, guidance_scale=4.0, seed=3)


@pytest.mark.parametrize("spec", FAMILIES, ids=[spec.name for spec in FAMILIES])
def test_the_families_that_take_one_are_those_whose_diffusers_pipeline_does(spec):
    import inspect

    import diffusers

    diffusers_call = inspect.signature(getattr(diffusers, spec.diffusers_pipeline).__call__).parameters
    assert takes_negative_prompt(spec) == ("negative_prompt" in diffusers_call)
    check_negative_prompt(spec, None)  # leaving it unset is always fine


@pytest.mark.parametrize("model", ["flux2-tiny", "flux2-klein-tiny"])
def test_a_config_negative_prompt_is_refused_naming_the_key(model):
    spec = model_spec(model)
    with pytest.raises(ConfigError) as err:
        image_call_kwargs(**REQUEST, negative_prompt="blurry", spec=spec)
    assert err.value.key == "generation.negative_prompt"
    assert f"{spec.diffusers_pipeline} takes no negative_prompt argument" in str(err.value)
    assert "negative_prompt" not in image_call_kwargs(**REQUEST, negative_prompt=None, spec=spec)
    assert image_call_kwargs(**REQUEST, negative_prompt="blurry", spec=model_spec("flux-tiny"))["negative_prompt"]


def test_an_http_request_with_one_is_refused_naming_the_field():
    limits = RequestLimits("flux2-tiny", 64, 64, 4, 4.0, None, 2, 512, 512 * 512, 100, 100,
                           check_size=lambda w, h: None, no_negative_prompt="Flux2Pipeline")  # fmt: skip
    with pytest.raises(RequestError) as err:
        parse_request(json.dumps({"prompt": "a cat", "negative_prompt": "blurry"}), limits)
    assert err.value.param == "negative_prompt"
    assert str(err.value) == "negative_prompt is not taken by this model: its pipeline (Flux2Pipeline) has none"
    assert parse_request(json.dumps({"prompt": "a cat"}), limits).negative_prompt is None
