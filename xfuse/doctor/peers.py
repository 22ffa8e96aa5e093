"""``xfuse doctor --listen PORT`` / ``--peer HOST:PORT``: which local interfaces work between two hosts, both ways,
to pick ``comm.socket_ifname`` before a multi-node launch. The probing itself (greeting listener, ``reach``) is the
start-up network probe's (``xfuse.runtime.netprobe``)."""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass

from xfuse.runtime.netprobe import GreetingListener, Interface, local_interfaces, reach, reach_all, read_line

DOCTOR_PROTOCOL = "xfuse-doctor/1"


def serve_doctor(port: int, on_check=None) -> GreetingListener:
    """The listening side of ``xfuse doctor``: greets with this host's interfaces; asked to, connects back to each
    address the asking host lists and answers which it reached. ``on_check(request, answer)`` is told of each."""

    def answer(request: dict) -> dict:
        port_back, token = int(request["port"]), str(request["token"])
        addresses = [address for _, address in request["interfaces"]]
        errors = reach_all([(address, port_back, token) for address in addresses], float(request["timeout_s"]))
        results = dict(zip(addresses, errors, strict=True))
        reply = {"reach_back": results}
        if on_check is not None:
            on_check(request, reply)
        return reply

    greeting = {
        "protocol": DOCTOR_PROTOCOL,
        "host": socket.gethostname(),
        "interfaces": [[i.name, i.address] for i in local_interfaces()],
    }
    return GreetingListener(greeting, answer=answer, port=port)


@dataclass
class PeerReport:
    """What `ask_peer` found, by local interface."""

    peer: str
    greeting: dict | None  # the peer's greeting (None: not an xfuse doctor, or not reached)
    forward: dict[str, str | None]  # interface name -> why this host cannot reach the peer from it (None: it can)
    back: dict[str, str | None] | None  # interface name -> why the peer cannot reach it (None: can); None: unknown
    interfaces: list[Interface]

    def working(self) -> list[str]:
        """Interfaces that work both ways (or forward, where the way back could not be asked)."""
        return [
            i.name
            for i in self.interfaces
            if self.forward.get(i.name) is None and (self.back is None or self.back.get(i.name) is None)
        ]


def ask_peer(host: str, port: int, timeout_s: float) -> PeerReport:
    """From each local interface, connect to ``host:port``; if it is an ``xfuse doctor --listen``, ask it to
    connect back to each local address (what the peer's ranks would do to reach this host's ranks)."""
    interfaces = local_interfaces()
    address = socket.gethostbyname(host)
    forward, greeting = {}, None
    for interface in interfaces:
        why, answer = reach(address, port, timeout_s, source=interface)
        forward[interface.name] = why
        greeting = greeting or answer
    back = None
    if greeting is not None and greeting.get("protocol") == DOCTOR_PROTOCOL:
        token = secrets.token_hex(8)
        listener = GreetingListener({"token": token})
        try:
            request = {
                "host": socket.gethostname(),
                "port": listener.port,
                "token": token,
                "timeout_s": timeout_s,
                "interfaces": [[i.name, i.address] for i in interfaces],
            }
            with socket.create_connection((address, port), timeout=timeout_s * (len(interfaces) + 2)) as sock:
                read_line(sock)  # its greeting
                sock.sendall((json.dumps(request) + "\n").encode())
                reply = read_line(sock)
            by_address = (reply or {}).get("reach_back", {})
            back = {i.name: by_address.get(i.address, "not checked") for i in interfaces}
        finally:
            listener.close()
    return PeerReport(f"{host}:{port}", greeting, forward, back, interfaces)


def format_peer_report(report: PeerReport) -> list[str]:
    width = max((len(i.name) for i in report.interfaces), default=2)
    if report.greeting is None:
        head = f"peer {report.peer}: no xfuse doctor answered from any interface"
    elif report.greeting.get("protocol") == DOCTOR_PROTOCOL:
        theirs = ", ".join(f"{n} {a}" for n, a in report.greeting.get("interfaces", []))
        head = f"peer {report.peer}: xfuse doctor on {report.greeting.get('host')!r} (interfaces: {theirs})"
    else:
        head = f"peer {report.peer}: answered, not an xfuse doctor (the way back is not checked)"
    out = [head, "by local interface: this host -> peer | peer -> this host (what the peer's ranks need)"]
    for i in report.interfaces:
        there = "reaches it" if report.forward[i.name] is None else f"no ({report.forward[i.name]})"
        back = (
            "-"
            if report.back is None
            else ("reached" if report.back[i.name] is None else f"no ({report.back[i.name]})")
        )
        out.append(f"  {i.name:<{width}}  {i.address:<15}  {there} | {back}")
    working = report.working()
    out.append(
        f"works both ways: {', '.join(working)} (set comm.socket_ifname to the one every node has)"
        if working
        else "works both ways: none (no comm.socket_ifname can work between these hosts)"
    )
    return out
