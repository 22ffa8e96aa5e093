"""The multi-node reachability probe on one host (no namespaces needed): interface lookup, gloo's choice, the
greeting check, the start-up check between two "nodes" on loopback, and the verdict's text, table-driven."""

import threading

import pytest
import torch.distributed as dist

from xfuse.errors import ConfigError
from xfuse.runtime import netprobe
from xfuse.runtime.netprobe import GreetingListener, check_reachability, gloo_listen_choice, local_interfaces, reach


def test_local_interfaces_list_loopback_with_its_address():
    assert netprobe.Interface("lo", "127.0.0.1") in local_interfaces()


def test_listen_choice_follows_socket_ifname_then_the_environment_then_the_host_name(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_listen_choice("lo") == netprobe.ListenChoice("127.0.0.1", "lo", "comm.socket_ifname=lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert gloo_listen_choice(None).how == "GLOO_SOCKET_IFNAME=lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(netprobe.socket, "gethostname", lambda: "localhost")
    assert gloo_listen_choice(None) == netprobe.ListenChoice(
        "127.0.0.1", "lo", "host name 'localhost' resolves to it; comm.socket_ifname unset"
    )
    monkeypatch.setattr(netprobe.socket, "gethostname", lambda: "xfuse-no-such-host.invalid")
    assert gloo_listen_choice(None) == netprobe.ListenChoice(
        "127.0.0.1",
        "lo",
        "host name 'xfuse-no-such-host.invalid' resolves to no local address, so gloo falls back to loopback",
    )


def test_an_interface_without_an_address_is_refused_naming_the_ones_with_one(monkeypatch):
    monkeypatch.setattr(netprobe, "local_interfaces", lambda: [netprobe.Interface("lo", "127.0.0.1")])
    with pytest.raises(
        ConfigError,
        match=r"comm.socket_ifname: interface 'eth9' \(comm.socket_ifname=eth9\) is "
        r"down or has no IPv4 address; interfaces with one: lo 127.0.0.1",
    ):
        gloo_listen_choice("eth9")


def test_reach_checks_the_greeting_token():
    listener = GreetingListener({"token": "mine"})
    try:
        assert reach("127.0.0.1", listener.port, 2.0, token="mine") == (None, {"token": "mine"})
        why, _ = reach("127.0.0.1", listener.port, 2.0, token="theirs")
        assert why == "answered by another host or process (greeting 'mine')"
    finally:
        listener.close()
    assert reach("127.0.0.1", listener.port, 2.0, token="mine")[0] == "Connection refused"


def test_start_up_check_between_two_nodes_on_loopback_passes():
    store, errors = dist.HashStore(), {}

    def rank(r):
        try:
            check_reachability(store, r, 2, "lo", timeout_s=10, node=f"node {r}")
        except Exception as err:  # noqa: BLE001 - the test looks at it
            errors[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == {}
    results = [netprobe.json.loads(store.get(f"{netprobe.PROBE_PREFIX}/0/result/{r}")) for r in (0, 1)]
    addresses = sorted(i.address for i in local_interfaces())
    for prober, target in ((0, 1), (1, 0)):  # each reached the other at every address it has (all local here)
        assert sorted(row[1] for row in results[prober]) == addresses
        assert all(row[0] == target and row[2] is None for row in results[prober]), results


def test_start_up_check_times_out_naming_the_ranks_that_never_came():
    with pytest.raises(TimeoutError, match=r"network probe: rank\(s\) \[1\] did not publish their rank within"):
        check_reachability(dist.HashStore(), 0, 2, "lo", timeout_s=0.5, node="node 0")


def rank_info(node, choice, interfaces):
    return {"node": node, "choice": [choice[1], choice[0], "comm.socket_ifname=" + choice[0]], "interfaces": interfaces}


NODE0 = [["lo", "127.0.0.1"], ["eth0", "10.0.0.1"], ["eth1", "192.168.0.1"]]
NODE1 = [["lo", "127.0.0.1"], ["eth0", "10.0.0.2"], ["eth1", "192.168.1.1"]]


@pytest.mark.parametrize(
    "case, choice, reached, expected",
    [
        ("all reached", "eth0", {"10.0.0.1", "10.0.0.2"}, None),
        (
            "eth1 unreachable",
            "eth1",
            {"10.0.0.1", "10.0.0.2"},
            [
                "node 0 (ranks 0) would listen on eth1 192.168.0.1 (comm.socket_ifname=eth1), which node 1 (ranks 1) "
                "cannot reach (Network is unreachable); its interfaces that every other node reaches: eth0 10.0.0.1",
                "node 1 (ranks 1) would listen on eth1 192.168.1.1 (comm.socket_ifname=eth1), which node 0 (ranks 0) "
                "cannot reach (Network is unreachable); its interfaces that every other node reaches: eth0 10.0.0.2",
                "set comm.socket_ifname to an interface that works on every node, e.g. --set comm.socket_ifname=eth0",
            ],
        ),
        (
            "nothing works",
            "eth1",
            set(),
            [
                "node 0 (ranks 0) would listen on eth1 192.168.0.1 (comm.socket_ifname=eth1), which node 1 (ranks 1) "
                "cannot reach (Network is unreachable); its interfaces that every other node reaches: none",
                "node 1 (ranks 1) would listen on eth1 192.168.1.1 (comm.socket_ifname=eth1), which node 0 (ranks 0) "
                "cannot reach (Network is unreachable); its interfaces that every other node reaches: none",
                "no interface name works on every node: make one reachable, or name each node's with "
                "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in its environment",
            ],
        ),
    ],
)
def test_verdict_names_interface_address_peer_and_the_interfaces_that_work(case, choice, reached, expected):
    ranks = [rank_info("node 0", (choice, dict(NODE0)[choice]), NODE0)]
    ranks.append(rank_info("node 1", (choice, dict(NODE1)[choice]), NODE1))
    results = [  # what rank p found at each of rank q's addresses
        [[q, a, None if a in reached else "Network is unreachable"] for _, a in ranks[q]["interfaces"]]
        for p, q in ((0, 1), (1, 0))
    ]
    text = netprobe._verdict(ranks, results)
    if expected is None:
        assert text == ""
        return
    lines = text.splitlines()
    assert lines[0].startswith("the nodes cannot reach each other at the addresses their ranks would listen on")
    assert [line.strip() for line in lines[1:3]] == expected[:2]
    assert lines[3].strip().startswith(expected[2])
