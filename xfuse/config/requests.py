"""The request sections: ``generation`` (one request's parameters: ``xfuse generate``'s run, and ``xfuse serve``'s
defaults for a request's optional fields) and ``serve`` (where ``xfuse serve`` listens and what one request may ask)."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from typing_extensions import Self

from xfuse.config.section import NonEmptyStr, PositiveInt, Seconds, Section
from xfuse.errors import ConfigError

MAX_SEED = 2**63 - 1  # fits int64, so per-patch generator seeds can be derived without overflow surprises
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a served LoRA adapter's name (serve.lora_adapters)


class GenerationConfig(Section):
    """One request's parameters. ``height``/``width`` ``None`` means the model's default size.

    Video models only (``ModelSpec.video``; image models ignore them): ``num_frames`` ``None`` means the model's default
    clip (a preset's own, else the diffusers pipeline's: Wan 81); whether the VAE takes it (Wan: 4k + 1) needs the
    model and is checked by ``xfuse.build.default_video_size``. ``fps``: the frame rate ``xfuse generate`` writes.
    ``image``: image-to-video, the path of the clip's first frame (a family with an image-to-video pipeline on the same
    transformer: Wan 2.2 TI2V; ``xfuse.build.pipeline_class`` checks the model). ``lora``: ``xfuse generate``'s
    adapters and weights (``xfuse.build.check_lora_family`` checks the model; ``xfuse serve`` has its own,
    ``serve.lora_adapters``, picked per request). ``controlnet``: ``xfuse generate``'s ControlNet, a local diffusers
    ControlNet folder (SD3 / SD3.5 and FLUX.1 models; ``xfuse.build`` checks the model), with ``control_image`` and
    diffusers' ``controlnet_conditioning_scale``, ``control_guidance_start`` and ``control_guidance_end``. Whether the
    files exist is checked where they are opened (``xfuse.build.check_files``).
    """

    SECTION: ClassVar[str] = "generation"
    prompt: str = "A cat sitting on a windowsill at sunset, watercolor"
    negative_prompt: str | None = None
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    num_inference_steps: PositiveInt = 20
    guidance_scale: Annotated[float, Field(ge=0.0)] = 5.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    num_frames: PositiveInt | None = None
    # 16, not diffusers' export_to_video default of 10: Wan 2.1's released examples export at fps=16 (diffusers'
    # WanPipeline example, the Wan2.1 repository's sample_fps), its 81-frame default being a 5 s clip.
    fps: PositiveInt = 16
    image: NonEmptyStr | None = None
    # xfuse generate: LoRA files or folders applied to the run, with their weights (SD3 / SD3.5, FLUX.1 and Wan models)
    lora: dict[NonEmptyStr, float] = Field(
        default_factory=dict, description="a mapping of LoRA files or folders to their weights (numbers)"
    )
    # xfuse generate: a ControlNet (a diffusers ControlNet folder) and its control image, as diffusers' arguments
    controlnet: NonEmptyStr | None = None
    control_image: NonEmptyStr | None = None
    controlnet_conditioning_scale: Annotated[float, Field(ge=0.0)] = 1.0
    control_guidance_start: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    control_guidance_end: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @model_validator(mode="after")
    def _controlnet_with_its_image(self) -> Self:
        if (self.controlnet is None) != (self.control_image is None):
            given, missing = (
                ("controlnet", "control_image") if self.control_image is None else ("control_image", "controlnet")
            )
            raise ConfigError(
                f"generation.{missing}", f"is needed with generation.{given} (a ControlNet runs on a control image)"
            )
        return self

    @model_validator(mode="after")
    def _controlnet_without_image_to_video(self) -> Self:
        if self.controlnet is not None and self.image is not None:
            raise ConfigError("generation.controlnet", "does not run with generation.image (image-to-video)")
        return self

    @model_validator(mode="after")
    def _control_window_not_empty(self) -> Self:
        # An empty window: the ControlNet would act in no step (diffusers' SD3 and FLUX pipelines run it at scale 0)
        if self.control_guidance_start >= self.control_guidance_end:
            raise ConfigError(
                "generation.control_guidance_start",
                f"must be below generation.control_guidance_end (got {self.control_guidance_start} >= "
                f"{self.control_guidance_end})",
            )
        return self


class ServeConfig(Section):
    """``xfuse serve``: where it listens and what one request may ask for. The ``generation`` section gives the
    defaults of a request's optional fields (size, steps, guidance, negative prompt)."""

    SECTION: ClassVar[str] = "serve"
    host: NonEmptyStr = "127.0.0.1"  # loopback unless the operator opens it
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port (printed at start-up)
    model_name: NonEmptyStr | None = None  # the id in /v1/models and the requests' ``model``; null: the model's name
    max_queue: PositiveInt = 8  # requests waiting behind the running one; more get 429 + Retry-After
    # the work waiting behind the running request, in megapixel-steps (width x height x steps x images / 10^6);
    # auto: max_queue requests of the default size and steps. A request that would pass it gets 429 + Retry-After
    max_queued_work: Annotated[
        Annotated[float, Field(gt=0.0)] | Literal["auto"],
        Field(description="'auto' or a number of megapixel-steps > 0"),
    ] = "auto"
    max_images_per_request: PositiveInt = 4  # the largest ``n``
    # requests the loop runs in one pipeline call (one image each, the same size, steps, guidance, negative prompt and
    # adapters, at most batch_max_pixels pixels); 1: one request at a time
    max_batch: PositiveInt = 1
    batch_max_pixels: Annotated[int, Field(ge=256)] = 512 * 512  # measured: batches of 4 still 1.12x at 512² here
    # pipeline calls (each a batch, or one request) the loop streams through the pipeline together when they queue
    # together with the same adapters: the next one's patches enter while the last one's leave
    # (xfuse.parallel.request_stream); not with sequence parallelism or compile; 1: one call at a time
    max_inflight: PositiveInt = 1
    max_side: Annotated[int, Field(ge=16)] = 2048  # pixels, width and height alike
    max_pixels: Annotated[int, Field(ge=256)] = 2048 * 2048  # width x height
    max_steps: PositiveInt = 100  # the largest ``num_inference_steps``
    max_prompt_chars: PositiveInt = 4000
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20  # larger request bodies get 413 before they are read
    request_timeout_s: Seconds = 300.0  # a request not started within this is answered 503 and never runs
    heartbeat_interval_s: Annotated[  # rank 0 -> every rank while idle
        float,
        Field(
            gt=0.0,
            le=1.0,
            description="a number of seconds > 0 and at most 1.0 s: a dead or stalled rank must be noticed within "
            "about 2 s of idle time",
        ),
    ] = 1.0
    heartbeat_timeout_s: Seconds = 2.0  # a rank that does not answer within this is lost: the world stops
    # LoRA adapters every rank loads at start-up (name -> local file or folder); a request picks them by name
    lora_adapters: dict[str, NonEmptyStr] = Field(
        default_factory=dict, description="a mapping of adapter names to LoRA files or folders (paths on every rank)"
    )

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if not ADAPTER_NAME.fullmatch(name):
                raise ConfigError(
                    "serve.lora_adapters",
                    f"adapter names are 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
                    f"(got {name!r})",
                )
        return adapters
