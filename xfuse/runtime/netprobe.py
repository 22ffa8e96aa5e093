"""Can every node reach every other node at the address its ranks will listen on? Answered in a second, before
any process group exists (`check_reachability`, run by ``xfuse.runtime.world.init_parallel``); the same greeting
listener and ``reach`` answer it on demand between two hosts (``xfuse doctor --listen`` / ``--peer``:
``xfuse.doctor.peers``).

Why: gloo (and NCCL's socket transport) listen on one address per rank, chosen from ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` or, when unset, by resolving the host name. On a multi-homed host that can be an interface
the other nodes cannot reach; gloo then retries its connect until the process-group timeout and says only
"Connect timeout". The probe finds out first and names the interface, the address, the peer and the interfaces
that would work.

How: every rank listens on all its addresses (one ``0.0.0.0`` socket) and answers each connection with a greeting
line that carries its own token; peers publish (in the rendezvous store) their chosen address, all their interface
addresses and their port; every rank connects to every rank of another node at each of those addresses and checks
the greeting, so an address that reaches some other host's same-numbered interface (docker's 172.17.0.1 on every
host, 127.0.0.1) does not count. The results go back through the store and every rank computes the same verdict.
IPv4 only for the interface lists (``SIOCGIFADDR``, Linux).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from datetime import timedelta

from xfuse.errors import ConfigError
from xfuse.stderr import clock, write_stderr

SIOCGIFFLAGS, SIOCGIFADDR, IFF_UP = 0x8913, 0x8915, 0x1
PROBE_PREFIX = "xfuse/netprobe"
GREETING_BYTES = 4096  # a greeting or an answer is one JSON line, well under this


@dataclass(frozen=True)
class Interface:
    """A local network interface that is up and has an IPv4 address."""

    name: str
    address: str


@dataclass(frozen=True)
class ListenChoice:
    """The address a rank's gloo device will listen on, and how it was chosen."""

    address: str
    interface: str | None  # the local interface holding ``address`` (None: not found among them)
    how: str  # e.g. "comm.socket_ifname=eth1", or "host name 'node0' resolves to it (comm.socket_ifname unset)"


def local_interfaces() -> list[Interface]:
    """The interfaces of this host that are up and have an IPv4 address, in ``if_nameindex`` order."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                (flags,) = struct.unpack_from("H", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request), 16)
                if not flags & IFF_UP:
                    continue
                # struct ifreq: the name (16 bytes), then a sockaddr_in whose address sits at bytes 20-23
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            found.append(Interface(name, address))
    return found


def _bindable(address: str, family: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def gloo_listen_choice(socket_ifname: str | None) -> ListenChoice:
    """The address gloo's TCP device will listen on in this process.

    Mirrors torch's ``ProcessGroupGloo::createDefaultDevice`` / ``createDeviceForInterface``
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) and gloo's ``lookupAddrForIface`` / ``lookupAddrForHostname``:
    ``GLOO_SOCKET_IFNAME`` (which ``comm.socket_ifname`` sets) names the interface, whose first address is used;
    otherwise the first address the host name resolves to that can be bound; otherwise the loopback address.
    """
    interfaces = local_interfaces()
    by_address = {i.address: i.name for i in interfaces}
    env_name = (os.environ.get("GLOO_SOCKET_IFNAME") or "").split(",")[0] or None
    name = socket_ifname or env_name
    if name is not None:
        how = f"comm.socket_ifname={name}" if socket_ifname else f"GLOO_SOCKET_IFNAME={name}"
        for interface in interfaces:
            if interface.name == name:
                return ListenChoice(interface.address, name, how)
        raise ConfigError(
            "comm.socket_ifname",
            f"interface {name!r} ({how}) is down or has no IPv4 address; interfaces with one: "
            + ", ".join(f"{i.name} {i.address}" for i in interfaces),
        )
    hostname = socket.gethostname()
    try:
        candidates = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror:
        candidates = []
    for family, _, _, _, sockaddr in candidates:
        if _bindable(sockaddr[0], family):
            how = f"host name {hostname!r} resolves to it; comm.socket_ifname unset"
            return ListenChoice(sockaddr[0], by_address.get(sockaddr[0]), how)
    how = f"host name {hostname!r} resolves to no local address, so gloo falls back to loopback"
    return ListenChoice("127.0.0.1", by_address.get("127.0.0.1"), how)


class GreetingListener:
    """A TCP listener on every local address (``0.0.0.0``, port chosen by the kernel) that answers each connection
    with ``greeting`` (one JSON line); with ``answer``, it then reads one request line and writes
    ``answer(request)`` back. Connections are served one at a time on a daemon thread until `close`."""

    def __init__(self, greeting: dict, answer=None, port: int = 0):
        self.greeting = (json.dumps(greeting) + "\n").encode()
        self.answer = answer
        self._sock = socket.create_server(("0.0.0.0", port), backlog=128)
        self._sock.settimeout(0.2)  # the accept loop looks at the stop flag this often
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="xfuse-netprobe-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.settimeout(30.0)
                    conn.sendall(self.greeting)
                    if self.answer is not None:
                        request = read_line(conn)
                        if request is not None:
                            conn.sendall((json.dumps(self.answer(request)) + "\n").encode())
                except (OSError, ValueError):  # a client that went away or sent garbage: serve the next one
                    continue

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5.0)


def read_line(conn: socket.socket) -> dict | None:
    data = b""
    while not data.endswith(b"\n") and len(data) < GREETING_BYTES:
        chunk = conn.recv(GREETING_BYTES)
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data.endswith(b"\n") else None


def _error_text(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    return err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"


def reach(
    address: str, port: int, timeout_s: float, token: str | None = None, source: Interface | None = None
) -> tuple[str | None, dict | None]:
    """Connect to ``address:port`` and read its greeting. Returns ``(None, greeting)`` when it answered (with
    ``token``, when one is given), else ``(why not, None)``. ``source``: leave through that interface (its address
    as the source; also the device itself where permitted, SO_BINDTODEVICE needs CAP_NET_RAW)."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            if source is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, source.name.encode())
                except (OSError, AttributeError):  # not permitted: the source address alone picks the way back
                    pass
                sock.bind((source.address, 0))
            sock.connect((address, port))
            greeting = read_line(sock)
    except (OSError, ValueError) as err:
        return _error_text(err), None
    if greeting is None:
        return "connected, but no greeting came back (another service?)", None
    if token is not None and greeting.get("token") != token:
        return f"answered by another host or process (greeting {greeting.get('token')!r})", None
    return None, greeting


def reach_all(targets: list[tuple[str, int, str]], timeout_s: float) -> list[str | None]:
    """`reach` each ``(address, port, token)`` at once; the errors in order (None: reached)."""
    if not targets:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        futures = [pool.submit(reach, address, port, timeout_s, token) for address, port, token in targets]
        return [future.result()[0] for future in futures]


# --- the start-up check ---------------------------------------------------------------------------------------
def _node_of_this_process() -> str:
    """This process's node: torchrun's node rank (``GROUP_RANK``), else the host name and its addresses."""
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank is not None:
        return f"node {group_rank}"
    addresses = ", ".join(i.address for i in local_interfaces() if not i.address.startswith("127."))
    return f"host {socket.gethostname()} ({addresses})"


def check_reachability(
    store, rank: int, world_size: int, socket_ifname: str | None, timeout_s: float, node: str | None = None
) -> None:
    """Before the process group is created: raise `ConfigError` on every rank (the same text) if some rank's gloo
    listen address cannot be reached from a rank on another node. Bounded: every store wait by ``timeout_s``, every
    connect by ``min(3, timeout_s)``. Ranks all on one node exchange one store round and connect to nothing.
    ``node``: this rank's node (default: torchrun's ``GROUP_RANK``, else the host)."""
    store = _prefixed(store)
    choice = gloo_listen_choice(socket_ifname)
    token = f"rank {rank} {secrets.token_hex(8)}"
    interfaces = local_interfaces()
    mine = {
        "node": node or _node_of_this_process(),
        "choice": [choice.address, choice.interface, choice.how],
        "interfaces": [[i.name, i.address] for i in interfaces],
        "token": token,
    }
    listener = GreetingListener({"token": token})
    try:
        mine["port"] = listener.port
        store.set(f"rank/{rank}", json.dumps(mine))
        ranks = _gather(store, "rank", world_size, timeout_s)
        targets = [
            (rank_q, address)
            for rank_q, info in enumerate(ranks)
            if info["node"] != mine["node"]
            for address in dict.fromkeys([info["choice"][0], *(a for _, a in info["interfaces"])])
        ]
        errors = reach_all(
            [(address, ranks[q]["port"], ranks[q]["token"]) for q, address in targets], min(3.0, timeout_s)
        )
        store.set(f"result/{rank}", json.dumps([[q, a, e] for (q, a), e in zip(targets, errors, strict=True)]))
        results = _gather(store, "result", world_size, timeout_s)
    finally:
        listener.close()
    verdict = _verdict(ranks, results)
    if verdict:
        error = ConfigError("comm.socket_ifname", verdict)
        # Every rank says it before any rank leaves: torchrun terminates a node's other ranks as soon as one exits.
        write_stderr(f"[xfuse {clock()}] rank {rank} failed at start-up: ConfigError: {error}")
        error.reported = True
        store.set(f"reported/{rank}", "1")
        with contextlib.suppress(TimeoutError):
            _gather(store, "reported", world_size, timeout_s)
        raise error


def _prefixed(store):
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted world must not read the last one's
    return dist.PrefixStore(f"{PROBE_PREFIX}/{restart}", store)


def _gather(store, kind: str, world_size: int, timeout_s: float) -> list:
    keys = [f"{kind}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 - the store's own timeout error: say which ranks never arrived
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(
            f"network probe: rank(s) {missing} did not publish their {kind} within comm.timeout_s = {timeout_s} s "
            f"({type(err).__name__})"
        ) from None
    return [json.loads(store.get(key)) for key in keys]


def _verdict(ranks: list[dict], results: list[list]) -> str:
    """The same text on every rank: for each node some other node cannot reach at its listen address, which
    interface and address that was, who could not reach it and why, and its interfaces every other node reached."""
    failed: dict[tuple[str, int], dict[int, str]] = {}  # (node, a rank of it) -> {rank that failed: why}
    reached: dict[int, dict[str, set[int]]] = {}  # rank -> {address: ranks that reached it}
    for prober, rows in enumerate(results):
        for target, address, error in rows:
            if error is None:
                reached.setdefault(target, {}).setdefault(address, set()).add(prober)
            elif address == ranks[target]["choice"][0]:
                failed.setdefault((ranks[target]["node"], target), {})[prober] = error

    def reached_from_every_other_node(target: int, address: str) -> bool:
        others = {r for r, other in enumerate(ranks) if other["node"] != ranks[target]["node"]}
        return others <= reached.get(target, {}).get(address, set())

    lines, seen_nodes = [], set()
    for (node, target), probers in sorted(failed.items(), key=lambda item: item[0][1]):
        if node in seen_nodes:  # ranks of one node share its interfaces: one line per node
            continue
        seen_nodes.add(node)
        info = ranks[target]
        address, interface, how = info["choice"]
        node_ranks = [r for r, other in enumerate(ranks) if other["node"] == node]
        why = probers[min(probers)]
        by_node: dict[str, list[int]] = {}
        for prober in sorted(probers):
            by_node.setdefault(ranks[prober]["node"], []).append(prober)
        unreached_from = "; ".join(f"{other} (ranks {_ranks(members)})" for other, members in by_node.items())
        working = [f"{name} {addr}" for name, addr in info["interfaces"] if reached_from_every_other_node(target, addr)]
        lines.append(
            f"{node} (ranks {_ranks(node_ranks)}) would listen on {interface or 'no local interface'} {address} "
            f"({how}), which {unreached_from} cannot reach ({why}); its interfaces that every other node reaches: "
            + (", ".join(working) or "none")
        )
    if not lines:
        return ""
    addresses = [dict(info["interfaces"]) for info in ranks]  # per rank: interface name -> address
    good = sorted(  # interface names every rank has and every other node reaches it at
        name
        for name in set.intersection(*(set(named) for named in addresses))
        if all(reached_from_every_other_node(rank, named[name]) for rank, named in enumerate(addresses))
    )
    advice = (
        f"set comm.socket_ifname to an interface that works on every node, e.g. --set comm.socket_ifname={good[0]}"
        if good
        else "no interface name works on every node: make one reachable, or name each node's with GLOO_SOCKET_IFNAME"
        " / NCCL_SOCKET_IFNAME in its environment"
    )
    return (
        "the nodes cannot reach each other at the addresses their ranks would listen on (checked at start-up, "
        "before any collective):\n  " + "\n  ".join(lines) + f"\n  {advice}; `xfuse doctor --peer HOST:PORT` checks "
        "each interface between two hosts"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
