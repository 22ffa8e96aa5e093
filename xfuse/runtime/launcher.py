"""``xfuse serve|generate --nproc-per-node N``: the command the operator runs starts the ranks of one node itself.

What torchrun does for one node, with the signals and exit code a supervisor (systemd, Kubernetes, a terminal)
expects of the process it started:

* The rendezvous is torch's own: this process hosts the c10d ``TCPStore`` (on a port the kernel picks, so no port is
  raced for) and every rank joins it through ``env://`` as torchrun's ranks join their agent's store
  (``TORCHELASTIC_USE_AGENT_STORE``). Each rank is ``python -m xfuse <the same command>`` with torchrun's environment
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, a run id).
* The ranks run in a session of their own, so a terminal's Ctrl-C reaches only this process. SIGTERM or SIGINT here
  is forwarded to every rank as SIGTERM (a served world drains: the running request is answered, new ones get 503),
  and this process exits 0 with one line once every rank has exited 0; a second signal kills the ranks.
* A rank that fails (a non-zero exit, or killed by a signal) is named in one line; the other ranks get SIGTERM, then
  SIGKILL after ``KILL_AFTER_S``, and this process exits with 1. No launcher traceback, no process left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from xfuse.stderr import write_stderr

POLL_S = 0.05  # how often the ranks' exit is looked at
KILL_AFTER_S = 30.0  # a rank that has not exited this long after a failure elsewhere is killed


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None

    def describe(self) -> str:
        code = self.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"rank {self.rank} (pid {self.proc.pid}) {how}"

    def signal(self, sig: int) -> None:
        if not self.exited:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def rank_environment(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The environment torchrun gives a rank of a one-node world whose agent hosts the store on ``port``."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
    )
    if nproc > 1:  # as torchrun does for several ranks on one node: one thread each unless the user says otherwise
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(command: str, argv: list[str], nproc: int) -> int:
    """Run ``python -m xfuse <argv>`` as ``nproc`` ranks on this node until they exit; return this command's exit
    code (0: every rank exited 0). ``command`` names the subcommand in the lines printed."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)  # the agent's store, as torchrun's
    run_id = uuid.uuid4().hex[:12]
    stop: list[int] = []  # the signals received, in order

    def on_signal(signum, frame) -> None:
        stop.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    ranks: list[_Rank] = []
    try:
        for rank in range(nproc):
            env = rank_environment(rank, nproc, store.port, run_id)
            proc = subprocess.Popen([sys.executable, "-m", "xfuse", *argv], env=env, start_new_session=True)
            ranks.append(_Rank(rank, proc))
        return _supervise(command, ranks, stop)
    finally:
        for rank in ranks:  # whatever happened: nothing is left behind
            rank.signal(signal.SIGKILL)
            rank.proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store


def _supervise(command: str, ranks: list[_Rank], stop: list[int]) -> int:
    """Wait for the ranks, forwarding a stop signal and stopping the world when one fails."""
    forwarded, failed, failed_at = 0, None, 0.0
    while not all(rank.exited for rank in ranks):
        if len(stop) > forwarded:  # the first signal drains (SIGTERM to every rank), a second one kills
            sig = signal.SIGTERM if forwarded == 0 else signal.SIGKILL
            for rank in ranks:
                rank.signal(sig)
            forwarded = len(stop)
        if failed is None:
            failed = next((r for r in ranks if r.exited and r.proc.returncode != 0), None)
            if failed is not None:
                failed_at = time.monotonic()
                for rank in ranks:
                    rank.signal(signal.SIGTERM)
        elif time.monotonic() - failed_at > KILL_AFTER_S:
            for rank in ranks:
                rank.signal(signal.SIGKILL)
        time.sleep(POLL_S)
    if failed is None:
        failed = next((r for r in ranks if r.proc.returncode != 0), None)
    if failed is not None:
        others = [r.describe() for r in ranks if r is not failed and r.proc.returncode != 0]
        also = f"; then {', '.join(others)}" if others else ""
        write_stderr(f"xfuse {command}: {failed.describe()}{also}: the world stopped (exit 1)")
        return 1
    if stop:
        name = signal.Signals(stop[0]).name
        write_stderr(f"xfuse {command}: stopped by {name}: every rank of {len(ranks)} exited 0")
    return 0
