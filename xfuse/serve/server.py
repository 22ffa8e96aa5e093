"""``xfuse serve``: one torchrun world serving images until it is stopped.

Rank 0 binds the port and starts the HTTP server first (``/health`` answers 503 "starting" while the model loads),
then every rank loads its share of the model and enters its loop (``xfuse.serve.loop``). The way out:

* drained (SIGTERM/SIGINT on any rank of a healthy world): the running request finishes, queued ones get 503,
  every rank answers ``shutdown`` and exits 0;
* anything else (a rank dead or stalled, idle or mid-request; an exception): rank 0 marks the service broken
  (``/health`` 503 naming the rank and the cause, every pending request 503), lets those answers go out, and every
  surviving rank exits non-zero, so torchrun or the orchestrator restarts the world. A broken world never exits 0,
  even when the launcher's SIGTERM arrives first.

The served model is resolved once, at the top of :func:`serve` (``xfuse.families.registry.resolve``); the checks,
the build, the request limits and the loop read that one ``ResolvedModel``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn

from xfuse.build import (
    build_pipeline,
    check_lora_family,
    check_negative_prompt,
    default_size,
    image_call_kwargs,
    load_lora_adapters,
    takes_negative_prompt,
    warm_up_compile,
)
from xfuse.config import XfuseConfig
from xfuse.errors import ConfigError
from xfuse.families.registry import resolve
from xfuse.runtime.heap import collector_paused
from xfuse.serve.control import ControlPlane, RankLost
from xfuse.serve.loop import DrainSignal, server_loop, worker_loop
from xfuse.serve.metrics import ServeMetrics
from xfuse.serve.protocol import RequestLimits, work_of
from xfuse.serve.service import Service
from xfuse.stderr import clock, write_stderr

if TYPE_CHECKING:
    from xfuse.families.registry import ResolvedModel

LINGER_S = 1.5  # a broken rank 0 keeps answering (503) this long, so probes and waiting clients hear why
NAMING_WAIT_S = 3.0  # how long a failure report waits for a lost rank's heartbeat to go stale (to name it): its
# staleness bound (1 s) and a poll, with room for a loaded machine


class HttpServer:
    """uvicorn in a background thread, on a socket bound here: a port in use is a start-up error naming it."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family)
        except OSError as err:
            raise ConfigError("serve.port", f"cannot listen on {host}:{port}: {err.strerror} (got {port})") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        self.app = app
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="xfuse-http", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def linger(self, seconds: float) -> None:
        """Keep answering for ``seconds`` and until the requests being answered are out (at most 2x)."""
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds or (self.app.state.inflight and elapsed < 2 * seconds):
            time.sleep(0.05)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def model_name(config: XfuseConfig, model: ResolvedModel) -> str:
    """The id clients use: ``serve.model_name``, else the preset's name or the model folder's name."""
    if config.serve.model_name:
        return config.serve.model_name
    return model.name if model.preset else os.path.basename(os.path.normpath(model.name))


def request_limits(config: XfuseConfig, model: ResolvedModel, pipe) -> RequestLimits:
    """What requests may ask, from the config, its model and the loaded pipeline; the default size must itself be
    servable."""
    stage, spec = pipe.stage.config, model.spec

    def check_size(width: int, height: int) -> None:
        spec.check_layout(
            pipe.parallel,
            num_blocks=pipe.num_blocks,
            patch_size=stage.patch_size,
            height=height,
            width=width,
            num_heads=spec.num_heads(stage),
        )

    width, height = default_size(config, model)
    check_size(width, height)  # a bad generation.width/height fails the start, naming the key
    queued_work = config.serve.max_queued_work
    if queued_work == "auto":  # a full queue of default requests
        queued_work = config.serve.max_queue * work_of(width, height, config.generation.num_inference_steps)
    check_negative_prompt(spec, config.generation.negative_prompt)  # fails the start, naming the key
    serve, gen = config.serve, config.generation
    return RequestLimits(
        model_name=model_name(config, model),
        default_width=width,
        default_height=height,
        default_steps=gen.num_inference_steps,
        default_guidance=gen.guidance_scale,
        default_negative_prompt=gen.negative_prompt,
        max_images=serve.max_images_per_request,
        max_side=serve.max_side,
        max_pixels=serve.max_pixels,
        max_steps=serve.max_steps,
        max_prompt_chars=serve.max_prompt_chars,
        check_size=check_size,
        max_queued_work=queued_work,
        # cfg_degree 2 needs each request to batch [uncond, cond]: guidance above the family's threshold (Z-Image's 0);
        # a true-CFG family's batch comes from the negative prompt instead (its pipeline refuses a request without)
        min_guidance_exclusive=spec.cfg_above
        if config.parallel.cfg_degree == 2 and not spec.negative_prompt_guides
        else None,
        adapters=tuple(serve.lora_adapters),
        no_negative_prompt=None if takes_negative_prompt(spec) else spec.diffusers_pipeline,
    )


def _say(text: str) -> None:
    write_stderr(f"[xfuse {clock()}] {text}")


def _lost_ranks(monitor, err: BaseException) -> str:
    """Name the ranks whose loss caused ``err``: `RankLost` names them; otherwise wait (briefly) for a dead or
    stopped rank's heartbeat to go stale."""
    if isinstance(err, RankLost) and err.ranks:
        return ""
    deadline = time.monotonic() + NAMING_WAIT_S
    while time.monotonic() < deadline:
        silent = monitor.silent_ranks()
        if silent:
            return silent
        time.sleep(0.1)
    return ""


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = str(err) if isinstance(err, RankLost) else f"{type(err).__name__}: {err}"
    line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _exit_now(monitor, code: int) -> NoReturn:
    """Leave without finalizing: the main thread's collectives may be half done (see xfuse.runtime.world)."""
    monitor.stop(timeout_s=2.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail_server(pipe, service: Service, http: HttpServer, err: BaseException) -> NoReturn:
    monitor = pipe.context.monitor
    reason = _one_line(err)
    first = monitor.record(err)
    service.set_broken(reason, answer=False)  # from now on /health is 503 and nothing new is taken
    silent = _lost_ranks(monitor, err)
    if silent:  # the lost rank first: the gloo or channel error may name only an address
        reason = f"{silent}; {reason}"
    service.set_broken(reason)  # pending requests answered with the lost rank's name, as /health says it
    own = first.rank == 0
    # (the report adds the silent ranks itself)
    headline = f"rank 0 stopped serving: {_one_line(err)}" + ("" if own else f"\n  first failure in the world: {first}")
    if monitor.reported:  # the pipeline's guard wrote the report already
        _say(headline)
    else:
        monitor.report(headline)
    http.linger(LINGER_S)
    http.stop(timeout_s=2.0)
    _exit_now(monitor, 1)


def _fail_worker(pipe, err: BaseException) -> NoReturn:
    monitor = pipe.context.monitor
    first = monitor.first()
    silent = _lost_ranks(monitor, err)
    lines = [f"rank {pipe.context.rank} stopped serving: {_one_line(err)}"]
    if first is not None and first.rank != pipe.context.rank:
        lines.append(f"first failure in the world: {first}")
    if silent:
        lines.append(silent)
    if monitor.reported:
        _say("\n  ".join(lines))
    else:
        monitor.report("\n  ".join(lines))
    _exit_now(monitor, 1)


def refuse_video_model(model: ResolvedModel) -> None:
    """A video model (``ModelSpec.video``: Wan) has no place in the Images API: refused by name (``ConfigError``,
    exit 2) on every rank before any port is bound or weights load."""
    if model.video:
        raise ConfigError(
            "model",
            f"{model.name} is a video model ({model.spec.diffusers_pipeline}); xfuse serve answers the OpenAI Images "
            f"API only: use xfuse generate for clips (got {model.name!r})",
        )


def check_adapters(config: XfuseConfig, model: ResolvedModel) -> None:
    """``serve.lora_adapters`` refused by name on every rank before any port is bound or weights load: a family whose
    diffusers pipeline loads no LoRA, a name that is the model's own (its paths: ``xfuse.build.check_files``); and
    ``generation.lora`` and ``generation.controlnet`` (``xfuse generate``'s: a server's adapters are picked per
    request, and a request carries no control image)."""
    if config.generation.lora:
        raise ConfigError(
            "generation.lora",
            "is xfuse generate's; xfuse serve loads serve.lora_adapters at start-up and each request picks them by "
            "name (its lora field)",
        )
    if config.generation.controlnet is not None:
        raise ConfigError(
            "generation.controlnet",
            "is xfuse generate's; xfuse serve takes no control image per request (use the ControlNet pipeline classes)",
        )
    adapters = config.serve.lora_adapters
    if not adapters:
        return
    check_lora_family(model, "serve.lora_adapters")
    if (name := model_name(config, model)) in adapters:
        raise ConfigError("serve.lora_adapters", f"adapter {name!r} has the served model's own name")


def load_adapters(pipe, adapters: dict[str, str]) -> None:
    """Every rank loads each adapter (its share of it) under its name; requests without ``lora`` run the base model."""
    for name, path in adapters.items():
        load_lora_adapters(pipe, {name: path}, f"serve.lora_adapters.{name}")
    if adapters:
        pipe.disable_lora()


def warm_up(pipe, config: XfuseConfig, model: ResolvedModel, limits: RequestLimits) -> None:
    """Any ``compile.mode`` but ``off``: compile ``compile.warmup_sizes`` (default: the default size) with the default
    request's arguments before serving; a size the model's layout cannot take fails the start, naming the key."""
    if pipe.compiler is None:
        return
    sizes = config.compile.warmup or [(limits.default_width, limits.default_height)]
    for width, height in sizes:
        try:
            limits.check_size(width, height)
        except ConfigError as err:
            raise ConfigError("compile.warmup_sizes", f"{width}x{height} cannot be served: {err}") from None
    if pipe.context.rank == 0:
        print(f"xfuse serve: compiling {len(sizes)} size(s) before the first request", flush=True)
    call = image_call_kwargs(prompt="warm-up", negative_prompt=limits.default_negative_prompt, width=sizes[0][0],
                             height=sizes[0][1], num_inference_steps=limits.default_steps,
                             guidance_scale=limits.default_guidance, seed=0, spec=model.spec)  # fmt: skip
    warm_up_compile(pipe, call, sizes)


def serve(config: XfuseConfig, *, api_key: str | None = None) -> int:
    """Run this rank's part of the service until it is drained (returns 0) or fails (exits non-zero)."""
    model = resolve(config.model)  # the one look-up of the served model; everything below reads it
    refuse_video_model(model)
    check_adapters(config, model)
    rank = int(os.environ.get("RANK", "0"))
    drain = DrainSignal()
    drain.install()
    service = http = None
    if rank == 0:
        from xfuse.serve.app import create_app

        par = config.parallel
        metrics = ServeMetrics(
            world_size=config.world_size,
            info={
                "model": model_name(config, model),
                "pipefusion_degree": str(par.pipefusion_degree),
                "cfg_degree": str(par.cfg_degree),
                "num_patches": str(par.resolved_num_patches),
                "warmup_steps": str(par.warmup_steps),
            },
        )
        settings = config.serve
        service = Service(
            world_size=config.world_size,
            max_queue=settings.max_queue,
            request_timeout_s=settings.request_timeout_s,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            metrics=metrics,
        )
        drain.service = service
        app = create_app(service, api_key=api_key, max_body_bytes=settings.max_body_bytes)
        http = HttpServer(app, settings.host, settings.port)
        http.start()
        print(f"xfuse serve: listening on {http.url} (starting: loading {config.model})", flush=True)
    try:
        with collector_paused():  # the load, to the frozen start-up heap (xfuse.runtime.heap)
            pipe = build_pipeline(config, model)
        pipe.set_progress_bar_config(disable=True)
        pipe.enable_cancellation()  # every rank: a request whose client went away stops between two steps
        load_adapters(pipe, config.serve.lora_adapters)
        limits = request_limits(config, model, pipe)  # every rank: a bad default size fails everywhere, the same way
        if service is not None and pipe.compiler is not None:  # /health: 503 "starting (compiling ...)" meanwhile
            mode = config.compile.mode
            service.reason = f"compiling the configured sizes before the first request (compile.mode: {mode})"
        warm_up(pipe, config, model, limits)
    except BaseException as err:
        if service is not None:
            service.set_broken(f"start-up failed: {type(err).__name__}: {err}")
            http.linger(LINGER_S)
            http.stop()
        raise
    context, settings = pipe.context, config.serve
    control = ControlPlane(
        rank=context.rank,
        world_size=context.world_size,
        group=context.control_group,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        idle_timeout_s=config.comm.timeout_s,
    )
    if rank != 0:
        try:
            worker_loop(pipe, model, control, drain)
        except BaseException as err:  # noqa: BLE001 - every way out but shutdown is a failure
            _fail_worker(pipe, err)
        return 0
    service.set_ready(limits)
    print(
        f"xfuse serve: ready on {http.url}: model {limits.model_name!r} on {context.world_size} rank(s), default "
        f"size {limits.default_width}x{limits.default_height}"
        + (f", LoRA adapters {', '.join(limits.adapters)}" if limits.adapters else ""),
        flush=True,
    )
    try:
        server_loop(
            pipe,
            model,
            control,
            service,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            drain=drain,
            http_alive=http.thread.is_alive,
            max_batch=settings.max_batch,
            batch_max_pixels=settings.batch_max_pixels,
            max_inflight=settings.max_inflight,
        )
    except BaseException as err:  # noqa: BLE001 - a lost rank or a failed request: the world restarts
        _fail_server(pipe, service, http, err)
    http.stop()
    _say("rank 0: drained; every rank answered the shutdown")
    return 0
