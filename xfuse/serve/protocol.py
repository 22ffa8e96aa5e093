"""The OpenAI Images API as ``xfuse serve`` speaks it: request schema, limits, the job that reaches the ranks, the
error envelope. Pure (pydantic only): rank 0's HTTP thread validates here, and nothing invalid goes further.

``POST /v1/images/generations`` takes OpenAI's fields (``prompt``, ``model``, ``n``, ``size``, ``response_format``,
``user``) and the diffusion fields other open diffusion servers (SGLang Diffusion, vLLM-Omni) take at the top level:
``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``; and ``lora``: one of the server's LoRA
adapters by name, or a weighted set ``{"name": weight, ...}`` (``serve.lora_adapters``; as in vLLM, a request may also
name an adapter as its ``model``). The ``openai`` client sends those through ``extra_body``. Unknown fields are
refused by name rather than ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from xfuse.config import MAX_SEED
from xfuse.errors import ConfigError

_SIZE = re.compile(r"^(\d{1,6})x(\d{1,6})$")


class ImageGenerationRequest(BaseModel):
    """The JSON body of ``POST /v1/images/generations`` (types only; limits are checked by `parse_request`)."""

    # strict: "4" is not 4, 1.0 is not 1, true is not 1; JSON numbers like 7 are still valid floats.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    lora: str | dict[str, float] | None = None


FIELDS = tuple(ImageGenerationRequest.model_fields)


class RequestError(ValueError):
    """A refused request: HTTP ``status``, OpenAI error ``type``/``code``, and the offending field (``param``)."""

    def __init__(self, message: str, *, param: str | None, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    @property
    def error_type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


def error_body(message: str, *, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this server: the ``serve`` section, the ``generation`` defaults and the model's
    size rule (``check_size(width, height)`` raises ``ConfigError`` naming what is wrong)."""

    model_name: str
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    default_negative_prompt: str | None
    max_images: int
    max_side: int
    max_pixels: int
    max_steps: int
    max_prompt_chars: int
    check_size: Callable[[int, int], None]
    min_guidance_exclusive: float | None = None  # cfg_degree 2 splits the CFG batch: guidance must exceed this
    adapters: tuple[str, ...] = ()  # the LoRA adapters loaded at start-up (serve.lora_adapters)
    no_negative_prompt: str | None = None  # the served diffusers pipeline, where it takes no negative_prompt
    max_queued_work: float = float("inf")  # megapixel-steps waiting behind the running request (serve.max_queued_work)


@dataclass(frozen=True)
class GenerationJob:
    """A validated request, as it travels to every rank (plain fields: pickled on the gloo control group)."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_images: int
    num_inference_steps: int
    guidance_scale: float
    seed: int | None  # None: rank 0 draws one (and returns it)
    lora: tuple[tuple[str, float], ...] = ()  # (adapter, weight) active for this request; empty: the base model

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def work(self) -> float:
        """What the request costs the world, in megapixel-steps (``serve.max_queued_work``'s unit): a denoising
        step's cost grows with the image's tokens, so width x height x steps x images, over 10^6."""
        return work_of(self.width, self.height, self.num_inference_steps, self.num_images)


def work_of(width: int, height: int, steps: int, images: int = 1) -> float:
    """Megapixel-steps of ``images`` images of ``width`` x ``height`` pixels denoised for ``steps`` steps."""
    return width * height * steps * images / 1e6


def _from_validation_error(err: ValidationError) -> RequestError:
    first = err.errors(include_url=False)[0]
    kind, loc = first["type"], [str(p) for p in first["loc"]]
    if kind == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first['msg']}", param=None, code="invalid_json")
    if kind == "model_type":
        return RequestError("the body must be a JSON object with a 'prompt' field", param=None, code="invalid_json")
    param = ".".join(loc) or None
    if kind == "missing":
        return RequestError(f"{param} is required", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return RequestError(
            f"{param} is not a field of this API (allowed: {', '.join(FIELDS)})", param=param, code="unknown_parameter"
        )
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    if loc[0] == "lora":  # a union: pydantic names the member type it tried last, which says nothing to a client
        return RequestError(
            f"lora must be an adapter's name or an object of adapter names to weights (numbers) (got {got})",
            param="lora",
            code="invalid_type",
        )
    return RequestError(f"{param}: {first['msg'].lower()} (got {got})", param=param, code="invalid_type")


def _check_text(name: str, value: str | None, limit: int, *, required: bool) -> None:
    if value is None:
        return
    if required and not value.strip():
        raise RequestError(f"{name} must be a non-empty string", param=name)
    if len(value) > limit:
        raise RequestError(f"{name} must be at most {limit} characters (got {len(value)})", param=name)


def parse_size(size: str | None, limits: RequestLimits) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (or ``"auto"``/absent: the default size) -> (width, height), within the limits and the
    model's rule."""
    if size is None or size == "auto":
        return limits.default_width, limits.default_height
    match = _SIZE.match(size)
    if match is None:
        raise RequestError(
            f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '{limits.default_width}x{limits.default_height}', or "
            f"'auto' (got {size[:40]!r})",
            param="size",
        )
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > limits.max_side or width * height > limits.max_pixels:
        raise RequestError(
            f"size must be at most {limits.max_side} pixels a side and {limits.max_pixels} pixels in all "
            f"(got {size!r})",
            param="size",
        )
    try:
        limits.check_size(width, height)
    except ConfigError as err:  # the model's own rule: VAE factor x patch size, enough token rows for the patches
        section, _, name = err.key.partition(".")
        # generation.height: ... -> "height ...": the request's own terms; a server key (parallel.*) stays named
        what = f"{name} {str(err)[len(err.key) + 2 :]}" if section == "generation" else str(err)
        raise RequestError(f"size {size!r} does not fit this model: {what}", param="size") from None
    return width, height


def parse_request(body: bytes | str, limits: RequestLimits) -> GenerationJob:
    """Validate a raw JSON body against the schema and ``limits``; raise `RequestError` naming the field."""
    try:
        request = ImageGenerationRequest.model_validate_json(body)
    except ValidationError as err:
        raise _from_validation_error(err) from None
    _check_text("prompt", request.prompt, limits.max_prompt_chars, required=True)
    _check_text("negative_prompt", request.negative_prompt, limits.max_prompt_chars, required=False)
    if request.negative_prompt is not None and limits.no_negative_prompt is not None:
        raise RequestError(
            f"negative_prompt is not taken by this model: its pipeline ({limits.no_negative_prompt}) has none",
            param="negative_prompt",
        )
    if request.model is not None and request.model not in (limits.model_name, *limits.adapters):
        raise RequestError(
            f"model {request.model[:80]!r} is not served here; this server serves {limits.model_name!r} "
            f"(GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    if request.response_format not in (None, "b64_json"):
        raise RequestError(
            "response_format must be 'b64_json': this server returns images in the response and never stores them "
            f"for a 'url' (got {request.response_format[:40]!r})",
            param="response_format",
        )
    n = 1 if request.n is None else request.n
    if not 1 <= n <= limits.max_images:
        raise RequestError(f"n must be an integer from 1 to {limits.max_images} (got {n})", param="n")
    steps = limits.default_steps if request.num_inference_steps is None else request.num_inference_steps
    if not 1 <= steps <= limits.max_steps:
        raise RequestError(
            f"num_inference_steps must be an integer from 1 to {limits.max_steps} (got {steps})",
            param="num_inference_steps",
        )
    guidance = limits.default_guidance if request.guidance_scale is None else request.guidance_scale
    if not (math.isfinite(guidance) and guidance >= 0):
        raise RequestError(f"guidance_scale must be a number >= 0 (got {guidance})", param="guidance_scale")
    if limits.min_guidance_exclusive is not None and not guidance > limits.min_guidance_exclusive:
        raise RequestError(
            f"guidance_scale must be > {limits.min_guidance_exclusive}: this server splits the classifier-free-"
            f"guidance batch over two rank groups (parallel.cfg_degree 2) (got {guidance})",
            param="guidance_scale",
        )
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise RequestError(f"seed must be an integer from 0 to {MAX_SEED} (got {request.seed})", param="seed")
    lora = _parse_lora(request, limits)
    width, height = parse_size(request.size, limits)
    negative = limits.default_negative_prompt if request.negative_prompt is None else request.negative_prompt
    return GenerationJob(
        prompt=request.prompt,
        negative_prompt=negative,
        width=width,
        height=height,
        num_images=n,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        seed=request.seed,
        lora=lora,
    )


def _parse_lora(request: ImageGenerationRequest, limits: RequestLimits) -> tuple[tuple[str, float], ...]:
    """The request's adapters and weights: ``lora`` (a name, or names with weights), or an adapter named as its
    ``model`` (weight 1); none: the base model."""
    chosen = request.lora
    if request.model in limits.adapters:
        if chosen is not None:
            raise RequestError(
                f"model {request.model!r} is a LoRA adapter; name adapters either as model or in lora, not both",
                param="lora",
            )
        chosen = request.model
    if chosen is None:
        return ()
    weights = {chosen: 1.0} if isinstance(chosen, str) else chosen
    if not weights:
        raise RequestError("lora must name at least one adapter (or leave it out for the base model)", param="lora")
    for name, weight in weights.items():
        if name not in limits.adapters:
            loaded = ", ".join(repr(a) for a in limits.adapters) or "none (serve.lora_adapters is empty)"
            raise RequestError(
                f"lora: {name[:80]!r} is not an adapter of this server; it has {loaded} (GET /v1/models)",
                param="lora",
                code="adapter_not_found",
            )
        if not math.isfinite(weight):
            raise RequestError(f"lora: the weight of {name!r} must be a finite number (got {weight})", param="lora")
    return tuple((name, float(weight)) for name, weight in weights.items())
