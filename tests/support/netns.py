"""Two "nodes" on one machine: network namespaces joined by a veth pair, each with a decoy interface.

    node 0 (namespace <tag>0)                        node 1 (namespace <tag>1)
      xfnet    10.231.0.1/24  <---- veth pair ---->    xfnet    10.231.0.2/24
      xfdecoy  10.232.0.1/24  (peer end: root ns)      xfdecoy  10.232.1.1/24  (peer end: root ns)
      host name -> 10.232.0.1 (/etc/netns/<ns>/hosts)  host name -> 10.232.1.1

Both nodes name their interfaces alike (a config's ``comm.socket_ifname`` is one value for every rank), the decoys
are up and addressed but route nowhere, and each node's host name resolves to its decoy (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``), which is what gloo listens on when no interface is
named. Needs root and ``ip netns``; `unusable_reason` says why not where they are missing.

Everything a `TwoNodes` made is removed on exit, also when a test or the set-up itself failed: every process it
started (found by a marker in its environment, so torchrun's workers too), both namespaces (which deletes their
veth ends and with them the peers), the ``/etc/netns`` folders. `leftovers` lists whatever of a tag remains.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODE_ADDRESSES = ("10.231.0.1", "10.231.0.2")
DECOY_ADDRESSES = ("10.232.0.1", "10.232.1.1")
MARKER = "XFUSE_NETNS_TEST"  # in the environment of every process a TwoNodes starts
RDZV_PORT = 29400


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unusable_reason() -> str | None:
    """Why two-node tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` for network namespaces"
    probe = f"xfprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        return f"`ip netns add` is not usable here: {getattr(err, 'stderr', '') or err}".strip()
    return None


class TwoNodes:
    def __init__(self, tag: str | None = None):
        self.tag = tag or f"xfn{os.getpid() % 100000}"
        self.namespaces = (f"{self.tag}a", f"{self.tag}b")
        self.procs: list[subprocess.Popen] = []

    # --- set-up and teardown --------------------------------------------------------------------------------
    def __enter__(self) -> TwoNodes:
        try:
            self._set_up()
        except BaseException:
            self.tear_down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.tear_down()

    def _set_up(self) -> None:
        hostname = os.uname().nodename
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        a, b = self.namespaces
        _ip("link", "add", f"{self.tag}x", "type", "veth", "peer", "name", f"{self.tag}y")
        for node, (ns, end) in enumerate(((a, f"{self.tag}x"), (b, f"{self.tag}y"))):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "name", "xfnet")
            _ip("-n", ns, "addr", "add", f"{NODE_ADDRESSES[node]}/24", "dev", "xfnet")
            _ip("-n", ns, "link", "set", "xfnet", "up")
            decoy, outside = f"{self.tag}d{node}", f"{self.tag}o{node}"  # the decoy's peer stays outside, unaddressed
            _ip("link", "add", decoy, "type", "veth", "peer", "name", outside)
            _ip("link", "set", decoy, "netns", ns)
            _ip("-n", ns, "link", "set", decoy, "name", "xfdecoy")
            _ip("-n", ns, "addr", "add", f"{DECOY_ADDRESSES[node]}/24", "dev", "xfdecoy")
            _ip("-n", ns, "link", "set", "xfdecoy", "up")
            _ip("link", "set", outside, "up")
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{DECOY_ADDRESSES[node]} {hostname}\n")

    def tear_down(self) -> None:
        self.kill_all()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for node in (0, 1):  # normally gone with the namespaces (a veth dies with its peer)
            subprocess.run(["ip", "link", "del", f"{self.tag}o{node}"], capture_output=True, timeout=30)

    def kill_all(self) -> None:
        for pid in self.marked_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while self.marked_pids() and time.monotonic() < deadline:
            time.sleep(0.1)

    def marked_pids(self) -> list[int]:
        """Processes started by this TwoNodes (torchrun agents and their workers), alive or zombie."""
        mark = f"{MARKER}={self.tag}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:  # gone, or not ours to read
                    continue
        return pids

    def leftovers(self) -> list[str]:
        """What of this tag still exists: namespaces, links, /etc/netns folders, processes."""
        left = []
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left += [f"namespace {ns}" for ns in self.namespaces if ns in names.split()]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        left += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if self.tag in line]
        left += [f"/etc/netns/{ns}" for ns in self.namespaces if (Path("/etc/netns") / ns).exists()]
        left += [f"process {pid}" for pid in self.marked_pids()]
        return left

    # --- running things on a node ---------------------------------------------------------------------------
    def start(self, node: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace, stdout and stderr to ``log``."""
        environ = {**os.environ, **(env or {}), MARKER: self.tag, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[node], *argv],
                cwd=ROOT,
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def torchrun(self, node: int, run_id: str, xfuse_args: list[str], log: Path, nproc: int = 2):
        """One torchrun agent of a 2-node job (c10d rendezvous hosted on node 0) running ``xfuse ...``."""
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={NODE_ADDRESSES[0]}:{RDZV_PORT}",
            f"--rdzv_id={run_id}",
            f"--rdzv_conf=is_host={int(node == 0)}",
            f"--local-addr={NODE_ADDRESSES[node]}",
            "-m",
            "xfuse",
            *xfuse_args,
        ]
        return self.start(node, argv, log)

    def set_link(self, node: int, up: bool) -> None:
        """Bring node ``node``'s end of the veth pair up or down (down: the nodes lose each other)."""
        _ip("-n", self.namespaces[node], "link", "set", "xfnet", "up" if up else "down")
