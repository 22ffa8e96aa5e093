"""The ``xfuse`` command line run inside a process that already imported torch and diffusers: on a test world's ranks
(``cli_rank``, importable by spawned ranks) as torchrun's ranks run it, and in the test process for one rank
(``cli_here``); an example script on a world's ranks as torchrun's ranks run it (``script_on_ranks``). For the tests
whose case is what the command or script does and prints, not its process: a launch costs each rank 4-5 s of CPU in
imports alone on the test machine. Exit codes, signals, faults and the launcher stay real processes
(tests/launch/test_launcher.py, test_faults.py, test_exit.py; one example under torchrun in test_cli.py)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.support import REPO


@dataclass
class CliRun:
    """What one process of the command returned and wrote (``subprocess.CompletedProcess``'s names)."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _captured_fds() -> Iterator[list[str]]:
    """File descriptors 1 and 2, and ``sys.stdout`` / ``sys.stderr`` (which pytest points elsewhere), into temporary
    files for the block: prints, warnings, C++ writes and handlers made inside it alike (a logging handler made
    before it keeps the stream it was given); their text in the yielded list, [stdout, stderr], once the block is
    over."""
    out: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved, streams = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
    files = [tempfile.TemporaryFile(mode="w+b"), tempfile.TemporaryFile(mode="w+b")]
    try:
        for fd, file in zip((1, 2), files, strict=True):
            os.dup2(file.fileno(), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - closed below
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        yield out
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = streams
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        for file in files:
            file.seek(0)
            out.append(file.read().decode(errors="replace"))
            file.close()


@contextlib.contextmanager
def _process_heap_left_alone() -> Iterator[None]:
    """``build_pipeline``'s process-wide settings skipped for the block: ``gc.freeze`` and glibc's ``mallopt`` (never
    trim, mmap threshold at its ceiling) belong to a process xfuse owns, and the test process is pytest's worker, where
    they would stay for every later test (a 48 MiB tensor then comes from the untrimmed heap already resident, and
    tests/unit/test_peak.py's phase read 0 MiB in a CI run). tests/launch/test_heap.py and test_pipeline.py check the
    settings themselves in real ranks; the world's ranks (``cli_rank``) apply them as xfuse's ranks do."""
    from xfuse import build

    kept = build.freeze_startup_heap, build.keep_freed_heap
    build.freeze_startup_heap, build.keep_freed_heap = lambda: None, lambda: False
    try:
        yield
    finally:
        build.freeze_startup_heap, build.keep_freed_heap = kept


def _main(argv: list[str], cwd: str, env: dict[str, str], frames_npy: str | None = None) -> CliRun:
    """``xfuse.cli.main(argv)`` in ``cwd`` with ``env`` added to the environment (both restored after).
    ``frames_npy``: the frames a video run hands to the CLI's clip writer are also saved there (``.npy``), so a test
    can compare the file written with the pipeline's own frames."""
    from xfuse import cli

    return _captured_run(lambda: cli.main(argv), cwd, env, frames_npy)


def _exit_code_of(body: Callable[[], int]) -> int:
    """``body()``'s exit code as ``python -m xfuse`` would end with it: argparse's refusals keep theirs, any other
    exception is printed (a traceback on stderr) and exits 1."""
    try:
        return body()
    except SystemExit as exit_:  # argparse's refusals
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - the test reads it as a failed run
        traceback.print_exc()
        return 1


def _rank_env() -> dict[str, str]:
    """``RANK`` and ``WORLD_SIZE`` of this rank of a test world, as torchrun sets them."""
    import torch.distributed as dist

    return {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size())}


def _as_one_run(runs: list[CliRun]) -> CliRun:
    """The ranks' runs read as one launch: the first failing rank's exit code (0 if none), rank 0's output (where the
    command prints) and every rank's errors."""
    code = next((run.returncode for run in runs if run.returncode), 0)
    return CliRun(code, runs[0].stdout, "".join(run.stderr for run in runs))


def _captured_run(body: Callable[[], int], cwd: str, env: dict[str, str], frames_npy: str | None = None) -> CliRun:
    """``body()`` (an exit code) in ``cwd`` with ``env`` added to the environment (both restored after), its output
    captured (``_captured_fds``); ``frames_npy`` as ``_main``'s."""
    import numpy as np

    from xfuse import cli

    write_clip = cli.write_clip

    def recorded(frames, output, fps):
        np.save(frames_npy, np.stack([np.asarray(frame) for frame in frames]))  # (T, H, W, 3) uint8
        return write_clip(frames, output, fps)

    before, here = dict(os.environ), os.getcwd()
    os.environ.update(env)
    os.chdir(cwd)
    if frames_npy is not None:
        cli.write_clip = recorded
    try:
        with _captured_fds() as text:
            code = _exit_code_of(body)
    finally:
        cli.write_clip = write_clip
        os.chdir(here)
        os.environ.clear()
        os.environ.update(before)
    return CliRun(code, *text)


def cli_rank(
    argv: list[str], cwd: str = str(REPO), env: dict[str, str] | None = None, frames_npy: str | None = None
) -> CliRun:
    """On every rank of a ``tests.support.world.World``: the command as a rank of a launched world (``RANK`` and
    ``WORLD_SIZE`` set, the world's process group already formed, which xfuse joins and leaves standing)."""
    return _main(argv, cwd, {**_rank_env(), **(env or {})}, frames_npy)


def cli_here(
    argv: list[str], cwd: str = str(REPO), env: dict[str, str] | None = None, frames_npy: str | None = None
) -> CliRun:
    """In this process, as ``python -m xfuse ...`` runs a one-rank world or a command that starts no rank (plan), but
    leaving this process's collector and C heap as they are (``_process_heap_left_alone``)."""
    assert "RANK" not in os.environ, "a one-rank command in a process that is a rank of a world"
    with _process_heap_left_alone():
        return _main(argv, cwd, env or {}, frames_npy)


def on_ranks(
    ranks,
    argv: list[str],
    cwd: str = str(REPO),
    frames_npy: str | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> CliRun:
    """``torchrun --nproc_per_node=N -m xfuse ARGV`` on the N ranks of ``ranks`` (a ``tests.support.world.World``), with
    ``env`` added to their environment, read as one launch (``_as_one_run``)."""
    return _as_one_run(ranks.run_ok(cli_rank, argv, cwd, env, frames_npy, timeout=timeout))


def on_a_fresh_world(
    argv: list[str], cwd: str = str(REPO), env: dict[str, str] | None = None, nproc: int = 2
) -> CliRun:
    """``on_ranks`` on a world of its own, closed after: new rank processes (forked from the preloaded server), where
    nothing ran yet, as in a new launch (dynamo's caches, for one, live in a process)."""
    from tests.support.world import World

    with World(nproc) as ranks:
        return on_ranks(ranks, argv, cwd, env=env)


def script_rank(path: str, args: list[str], cwd: str) -> CliRun:
    """On every rank of a ``tests.support.world.World``: ``python PATH ARGS`` as a rank of a launched world runs it
    (``__main__``, ``sys.argv``, ``RANK`` and ``WORLD_SIZE`` set, the world's process group already formed)."""
    import runpy

    def run() -> int:
        argv, sys.argv = sys.argv, [path, *args]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = argv
        return 0

    return _captured_run(run, cwd, _rank_env())


def script_on_ranks(ranks, path: str, args: list[str], cwd: str, timeout: float = 240) -> CliRun:
    """``torchrun --nproc_per_node=N PATH ARGS`` on the N ranks of ``ranks``, read as ``on_ranks`` reads a command;
    the script must leave the world's process group standing (xfuse's pipelines do: they joined it)."""
    return _as_one_run(ranks.run_ok(script_rank, path, args, cwd, timeout=timeout))


def command_then_exit(argv: list[str], env: dict[str, str], out_path: str, err_path: str) -> None:
    """On every rank of a ``tests.support.world.World``: ``xfuse ARGV`` as a rank torchrun started runs it (``RANK``
    and ``WORLD_SIZE`` set, ``env`` added: a drill's ``XFUSE_FAULT``), its file descriptors 1 and 2 appended to
    ``out_path`` and ``err_path`` (``{rank}`` in them: the rank's own files; else the ranks share them, as torchrun's
    ranks share its output) from the start, so a report written just before ``os._exit`` or a SIGKILL is kept and
    faulthandler's dump too; then the process ends with the command's exit code, as ``python -m xfuse`` ends. The
    failure paths end it sooner themselves (``os._exit`` from the monitor's thread, faulthandler's timer, the fault's
    SIGKILL): the world reads each rank's end as ``RankDied`` with its exit code, the rank's exit code under
    torchrun."""
    import torch.distributed as dist

    from xfuse import cli

    rank = dist.get_rank()
    for fd, path in ((1, out_path), (2, err_path)):
        log = os.open(path.format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process ends below
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update({**_rank_env(), **env})
    code = _exit_code_of(lambda: cli.main(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
