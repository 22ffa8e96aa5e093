"""Process groups and topology: world = cfg_degree x pipefusion_degree x ulysses_degree x ring_degree, launched by
torchrun (or a test world).

With ``sp = ulysses_degree * ring_degree`` ranks per sequence-parallel (SP) group, global rank g is
``(cfg_rank * pipefusion_degree + pipe_rank) * sp + sp_rank``: CFG group ``cfg_rank`` (0: the unconditional half, 1:
the conditional half when ``cfg_degree == 2``), pipeline rank ``pipe_rank``, SP index ``sp_rank`` (``ring_index *
ulysses_degree + ulysses_index``). An SP group's ranks are neighbours, so its all-to-alls stay on the fastest links
(xDiT's order too); a pipeline group is the ranks of one CFG group with the same SP index. Global rank 0 is pipeline
rank 0, SP index 0 of CFG group 0: it owns the text encoders, the VAE and the output. Everything here is created once
per process.

Teardown (``shutdown``, the one place that tears down what xfuse started in a process) goes in this order:

1. the failure monitor: its watcher thread calls into the rendezvous store. It is stopped and joined first, while
   the store and the process groups still exist and before the interpreter finalizes. A thread that returns from
   a store call (C++, GIL released) into a finalizing interpreter is ended by ``pthread_exit``; the forced unwind
   hits pybind11's noexcept ``gil_scoped_release`` destructor and calls ``std::terminate`` (issue 15: "terminate
   called without an active exception", SIGABRT after a successful generation, ~15 % of 4-rank runs).
2. the channels: closed (no further sends or receives), their idle receive buffers dropped.
3. the process groups: the default group and every subgroup, if xfuse created the default group (a world the
   caller created is the caller's to destroy).

It runs from the CLI on every path (success and error), and from ``atexit`` for library use (atexit handlers run
before the interpreter starts finalizing). Under SIGTERM the handler stops the monitor and leaves with
``os._exit`` without steps 2-3: the main thread may be inside a collective, and ``os._exit`` skips finalization.
"""

from __future__ import annotations

import atexit
import os
import socket
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from xfuse.comm.bounded_call import call_bounded
from xfuse.comm.groups import DirectionGroups, make_direction_groups
from xfuse.comm.p2p import P2PChannels
from xfuse.config import MAX_PIPEFUSION_DEGREE, CommConfig, ConfigError, ParallelConfig, RuntimeConfig, XfuseConfig
from xfuse.runtime.handshake import flatten, handshake, versions
from xfuse.runtime.host_deadline import HostDeadline
from xfuse.runtime.monitor import FailureMonitor, default_store
from xfuse.runtime.netprobe import check_reachability
from xfuse.stderr import write_stderr

# NCCL's own diagnostics, on unless the user set them: async error handling tears a failed communicator down instead
# of hanging, and the flight recorder dumps the last collectives/P2P ops of every rank on a timeout.
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/xfuse_nccl_trace_rank_",
}
# NCCL's own watchdog times an operation from its launch and ends the process with little to say; xfuse's (in
# xfuse.comm.watchdog) times it from its wait and names it. NCCL's stays as the backstop, this much later.
NCCL_BACKSTOP_S = 30.0


@dataclass
class ParallelContext:
    """Where this process sits, and the channels it talks through."""

    config: XfuseConfig  # the whole config every rank agreed on at start-up
    rank: int
    world_size: int
    pipe_rank: int
    cfg_rank: int
    pipe_ranks: list[int]  # global ranks of this rank's pipeline group, by pipeline rank
    cfg_peer: int | None  # the same pipeline rank in the other CFG group
    device: torch.device
    backend: str | None  # None: a single process, no process group
    channels: P2PChannels | None  # pipeline neighbours
    cfg_channels: P2PChannels | None  # the CFG peer
    control_group: dist.ProcessGroup | None  # gloo group for object collectives (None: the default group)
    monitor: FailureMonitor  # first-failure propagation across ranks
    sp_rank: int = 0  # index in this rank's sequence-parallel group
    sp_ranks: list[int] = field(default_factory=list)  # global ranks of that group, by SP index (empty: no SP)
    sp_channels: P2PChannels | None = None  # the SP group's other ranks
    world_channels: P2PChannels | None = None  # every other rank of the world (the band-parallel VAE decode)
    host_deadline: HostDeadline | None = None  # bounds the denoising loop's host outside its waits (None: off)

    @property
    def all_channels(self) -> list[P2PChannels]:
        """Every channel set this rank talks through (pipeline, CFG peer, SP group, the whole world)."""
        candidates = (self.channels, self.cfg_channels, self.sp_channels, self.world_channels)
        return [c for c in candidates if c is not None]

    @property
    def is_output(self) -> bool:
        """The rank that returns the pipeline's output (global rank 0)."""
        return self.rank == 0


def pipeline_group_ranks(parallel: ParallelConfig, cfg_rank: int = 0, sp_rank: int = 0) -> list[int]:
    """Global ranks of a pipeline group, by pipeline rank: CFG group ``cfg_rank``, index ``sp_rank`` of each
    sequence-parallel group (the defaults: the group of global rank 0, which also runs a split text encoder)."""
    pp, sp = parallel.pipefusion_degree, parallel.sequence_degree
    return [(cfg_rank * pp + p) * sp + sp_rank for p in range(pp)]


def check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """The world must have exactly the ranks the parallel degrees multiply to (the one home of this rule)."""
    others = parallel.cfg_degree * parallel.sequence_degree  # ranks per PipeFusion rank
    need = parallel.pipefusion_degree * others
    if need == world_size:
        return
    hint = f"start {need} ranks (xfuse ... --nproc-per-node {need}, or torchrun --nproc_per_node={need})"
    if world_size % others == 0 and 1 <= world_size // others <= MAX_PIPEFUSION_DEGREE:
        hint += f", or set parallel.pipefusion_degree={world_size // others} for {world_size} ranks"
    sequence = ""
    if parallel.sequence_degree > 1:
        sequence = (
            f" x parallel.ulysses_degree ({parallel.ulysses_degree}) x parallel.ring_degree ({parallel.ring_degree})"
        )
    raise ConfigError(
        "parallel.pipefusion_degree",
        f"parallel.pipefusion_degree ({parallel.pipefusion_degree}) x parallel.cfg_degree ({parallel.cfg_degree})"
        f"{sequence} = {need} ranks must equal the world size ({world_size}); {hint} "
        f"(got pipefusion_degree={parallel.pipefusion_degree}, cfg_degree={parallel.cfg_degree})",
    )


def resolve_device(runtime: RuntimeConfig) -> torch.device:
    if runtime.device == "cpu" or (runtime.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("runtime.device", "is cuda but no CUDA device is available; use auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_socket_ifname(comm: CommConfig) -> None:
    """Refuse a ``comm.socket_ifname`` this host does not have, listing the ones it has."""
    if comm.socket_ifname is None:
        return
    names = sorted(name for _, name in socket.if_nameindex())
    if comm.socket_ifname not in names:
        raise ConfigError(
            "comm.socket_ifname", f"no interface {comm.socket_ifname!r} on this host; it has: {', '.join(names)}"
        )


def apply_socket_ifname(comm: CommConfig) -> None:
    """Point gloo and NCCL at ``comm.socket_ifname`` (before the process group is created)."""
    check_socket_ifname(comm)
    if comm.socket_ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = comm.socket_ifname
        os.environ["NCCL_SOCKET_IFNAME"] = comm.socket_ifname


class _ProcessResources:
    """What xfuse started in this process: torn down by ``shutdown`` in the order of the module docstring."""

    def __init__(self) -> None:
        self.monitors: dict[tuple[int, int], FailureMonitor] = {}  # (rank, world size) -> its monitor
        self.channels: weakref.WeakSet[P2PChannels] = weakref.WeakSet()  # weak: a dropped pipeline frees them
        self.deadlines: weakref.WeakSet[HostDeadline] = weakref.WeakSet()
        self.owns_default_group = False


_RESOURCES = _ProcessResources()


def _process_monitor(rank: int, world: int) -> FailureMonitor:
    """One failure monitor (and watcher thread) per process and world, shared by every pipeline built in it."""
    key = (rank, world)
    if key not in _RESOURCES.monitors:
        _RESOURCES.monitors[key] = FailureMonitor(rank, default_store() if world > 1 else None, world_size=world)
    return _RESOURCES.monitors[key]


def _group_timeout(config: XfuseConfig, backend: str | None) -> timedelta:
    """A process group's own bound: xfuse's longest deadline (``XfuseConfig.longest_wait_s``), and for NCCL a
    backstop behind it (``NCCL_BACKSTOP_S``)."""
    return timedelta(seconds=max(config.longest_wait_s, 1.0) + (NCCL_BACKSTOP_S if backend == "nccl" else 0.0))


def shutdown(join_timeout_s: float = 10.0) -> bool:
    """Tear down what xfuse started in this process: monitor, then channels, then process groups (see the module
    docstring for why this order). Idempotent; safe to call when nothing was started.

    Returns:
        `bool`: False if a monitor's watcher thread could not be joined within ``join_timeout_s`` (it is inside a
        store call whose host does not answer), or destroying the process groups did not return within it (NCCL on
        a stopped device). The process must then not finalize the interpreter with that thread alive: the CLI
        leaves with ``os._exit``.
    """
    stopped = True
    for deadline in list(_RESOURCES.deadlines):
        deadline.stop()
    _RESOURCES.deadlines = weakref.WeakSet()
    for monitor in list(_RESOURCES.monitors.values()):
        stopped = monitor.stop(join_timeout_s) and stopped
    _RESOURCES.monitors.clear()
    for channels in list(_RESOURCES.channels):
        channels.close()
    _RESOURCES.channels = weakref.WeakSet()
    if _RESOURCES.owns_default_group and dist.is_initialized():
        # the default group and every subgroup xfuse created in it; on a device stopped by a kernel that never ends
        # NCCL's destroy never returns (NVIDIA/nccl#829): past the bound the process must leave without it
        destroyed = call_bounded(dist.destroy_process_group, join_timeout_s, "xfuse-destroy-process-group")
        if not destroyed:
            write_stderr(f"destroying the process groups did not return within {join_timeout_s:g} s (NCCL waits for "
                         "the device); leaving without it")  # fmt: skip
        stopped = destroyed and stopped
    _RESOURCES.owns_default_group = False
    return stopped


# A no-op when nothing was started; atexit handlers run before the interpreter starts finalizing.
atexit.register(shutdown)


def one_process_context(config: XfuseConfig, device: torch.device) -> ParallelContext:
    """The context of a world of one process on ``device``, joining no process group: what ``init_parallel`` gives
    a degree-1 config, on any device (``xfuse.perf.activations`` runs a pipeline on the meta device with it)."""
    check_world_size(config.parallel, 1)
    return ParallelContext(config=config, rank=0, world_size=1, pipe_rank=0, cfg_rank=0, pipe_ranks=[0],
                           cfg_peer=None, device=device, backend=None, channels=None, cfg_channels=None,
                           control_group=None, monitor=FailureMonitor(0, None, world_size=1))  # fmt: skip


def init_parallel(config: XfuseConfig) -> ParallelContext:
    """Join (or create) the process group, compare every rank's whole ``config`` (handshake), check the world size
    and build the topology. The context holds the config: everything below reads its sections from there."""
    parallel, comm, runtime = config.parallel, config.comm, config.runtime
    pp, cfg = parallel.pipefusion_degree, parallel.cfg_degree
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(runtime)
    check_socket_ifname(comm)  # also when the process group exists already: a wrong name is still wrong
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any NCCL call, or NCCL hangs
    backend = None
    if world > 1 and not dist.is_initialized():
        apply_socket_ifname(comm)
        backend = comm.resolved_backend(device.type)
        if backend == "nccl":
            for key, value in NCCL_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        timeout = _group_timeout(config, backend)
        if "MASTER_ADDR" in os.environ:  # env:// (torchrun): rendezvous first, so the probe runs before gloo connects
            # Mirrors torch.distributed.init_process_group's own env:// path (rendezvous, set_timeout, "default_pg").
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            check_reachability(store, rank, world, comm.socket_ifname, comm.timeout_s)
            store = dist.PrefixStore("default_pg", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        _RESOURCES.owns_default_group = True  # xfuse created it: shutdown() destroys it
    if dist.is_initialized():
        backend = dist.get_backend()
    control = (  # object collectives, and xfuse serve's control plane: CPU only, bounded like the data plane
        dist.new_group(backend="gloo", timeout=timedelta(seconds=max(comm.timeout_s, 1.0)))
        if backend not in (None, "gloo")
        else None
    )
    # Before the world check: ranks started with different configs must all say which field differs.
    handshake(
        {**versions(), **flatten("", config.to_dict())},
        world_size=world,
        group=control,
    )
    check_world_size(parallel, world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sp = parallel.sequence_degree
    cfg_rank, pipe_rank, sp_rank = rank // (pp * sp), rank // sp % pp, rank % sp
    all_pipes = [pipeline_group_ranks(parallel, c, s) for c in range(cfg) for s in range(sp)]
    all_sp = [[(c * pp + p) * sp + s for s in range(sp)] for c in range(cfg) for p in range(pp)]
    cfg_peer = None if cfg == 1 else (rank + pp * sp) % (2 * pp * sp)
    channels = cfg_channels = sp_channels = world_channels = None
    if world > 1:
        separate = backend != "gloo"
        device_id = device if backend == "nccl" else None
        group_timeout = _group_timeout(config, backend)  # the default group's

        def groups_of(all_groups: list[list[int]], size: int) -> DirectionGroups:
            mine = DirectionGroups()
            if size > 1:
                for ranks in all_groups:  # collective: every rank creates every group, in the same order
                    made = make_direction_groups(ranks, separate=separate, device_id=device_id, timeout=group_timeout)
                    if rank in ranks:
                        mine = made
            return mine

        pipe_groups, sp_groups = groups_of(all_pipes, pp), groups_of(all_sp, sp)
        kw = dict(
            rank=rank,
            timeout_s=comm.timeout_s,
            max_inflight=comm.max_inflight,
            device=device,
            stream_ordered=comm.stream_ordered(device.type),
        )
        channels = P2PChannels(groups=pipe_groups, **kw) if pp > 1 else None
        cfg_channels = P2PChannels(groups=DirectionGroups(), **kw) if cfg > 1 else None
        sp_channels = P2PChannels(groups=sp_groups, **kw) if sp > 1 else None
        # The default group, like the CFG peer's: the decode runs after the loop, when no other message is in flight.
        world_channels = P2PChannels(groups=DirectionGroups(), **kw)
    every = [c for c in (channels, cfg_channels, sp_channels, world_channels) if c is not None]
    _RESOURCES.channels.update(every)
    monitor = _process_monitor(rank, world)
    monitor.op_logs = [c.format_op_log for c in every]
    monitor.state_sources = [c.wait_state for c in every]
    for c in every:
        if c.watchdog is not None:  # a stuck device: tell the other ranks, then end the process
            c.watchdog.on_stuck = monitor.fail_from_thread
    host_timeout_s = comm.resolved_host_timeout_s(device.type)
    deadline = None
    if host_timeout_s is not None:
        deadline = HostDeadline(rank, host_timeout_s, waiting=lambda: any(c.in_bounded_wait() for c in every),
                                on_stuck=monitor.fail_from_thread)  # fmt: skip
        _RESOURCES.deadlines.add(deadline)
    # Every pair that streams to each other connected now, in the same order on every rank (pipeline, sequence, CFG):
    # NCCL would connect a pair at its first message, blocking the host (see P2PChannels.connect).
    if channels is not None:
        channels.connect([peer for peer in all_pipes[cfg_rank * sp + sp_rank] if peer != rank])
    if sp_channels is not None:
        sp_channels.connect([peer for peer in all_sp[cfg_rank * pp + pipe_rank] if peer != rank])
    if cfg_channels is not None:
        cfg_channels.connect([cfg_peer])
    return ParallelContext(
        config=config,
        rank=rank,
        world_size=world,
        pipe_rank=pipe_rank,
        cfg_rank=cfg_rank,
        pipe_ranks=all_pipes[cfg_rank * sp + sp_rank],
        cfg_peer=cfg_peer,
        device=device,
        backend=backend,
        channels=channels,
        cfg_channels=cfg_channels,
        control_group=control,
        monitor=monitor,
        sp_rank=sp_rank,
        sp_ranks=all_sp[cfg_rank * pp + pipe_rank] if sp > 1 else [],
        sp_channels=sp_channels,
        world_channels=world_channels,
        host_deadline=deadline,
    )
