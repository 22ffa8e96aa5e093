"""Multi-node for real: two torchrun agents in two network namespaces (tests/support/netns.py), 2 ranks each.

One pair of namespaces per module; each test starts its own 2-node job. The image of a 2-node run must equal the
single-node run's bit for bit; a decoy interface (named, or picked by host name) must be refused at start-up on
every rank, naming it; a node that loses its link must not strand anyone. Nothing may be left behind.
"""

import datetime
import re
import sys
import time

import numpy as np
import pytest
from PIL import Image

from tests.support.cli_fns import on_ranks
from tests.support.netns import DECOY_ADDRESSES, NODE_ADDRESSES, TwoNodes, unusable_reason
from tests.support.reports import parse_reports
from tests.support.world import World

REASON = unusable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-node tests: {REASON}")

TINY = ["--config", "configs/tiny/pp2.yaml"]
PP4 = ["--set", "parallel.pipefusion_degree=4", "--set", "parallel.num_patches=4"]
CFG2_PP2 = ["--set", "parallel.cfg_degree=2", "--set", "parallel.pipefusion_degree=2"]


@pytest.fixture(scope="module")
def nodes():
    with TwoNodes() as two:
        yield two
    assert two.leftovers() == []  # namespaces, links, /etc/netns folders and processes: all gone


def run_two_nodes(nodes, tmp_path, name, args, timeout_s=120, node_args=((), ())):
    """Both agents of one job (``node_args[n]``: node n's own arguments after ``args``); returns ([returncode per
    node], [log per node], wall seconds per node)."""
    start = time.monotonic()
    logs = [tmp_path / f"{name}.node{n}.log" for n in (0, 1)]
    procs = [nodes.torchrun(n, name, ["generate", *TINY, *args, *node_args[n]], logs[n]) for n in (0, 1)]
    ends = []
    for proc in procs:
        proc.wait(timeout=timeout_s)
        ends.append(time.monotonic() - start)
    return [p.returncode for p in procs], [log.read_text() for log in logs], ends


@pytest.fixture(scope="module")
def single_node():
    """The single-node reference's 4 ranks, on loopback in the root namespace: ``xfuse generate`` run as torchrun's
    ranks run it (``tests.support.cli_fns``); a 4-rank ``torchrun`` of its own cost each layout 10 s of imports and drew
    the same PNG bit for bit."""
    with World(4, start_timeout=300) as world:
        yield world


@pytest.mark.parametrize("layout", ["pp4", "cfg2_pp2"])
def test_two_node_image_equals_single_node_bit_for_bit(nodes, single_node, tmp_path, layout):
    args = {"pp4": PP4, "cfg2_pp2": CFG2_PP2}[layout]
    two, one = tmp_path / "two.png", tmp_path / "one.png"
    named = [*args, "--set", "comm.socket_ifname=xfnet", "-o", str(two)]
    codes, logs, _ = run_two_nodes(nodes, tmp_path, layout, named)
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert "on 4 rank(s)" in "".join(logs)
    alone = on_ranks(single_node, ["generate", *TINY, *args, "-o", str(one)])
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert np.array_equal(np.asarray(Image.open(two)), np.asarray(Image.open(one)))


def test_a_decoy_interface_named_or_picked_by_host_name_is_refused_at_start_up_on_every_rank(nodes, tmp_path):
    """Node 0 names the decoy (``comm.socket_ifname=xfdecoy``), node 1 leaves it unset and its host name resolves to
    its decoy address: one job, each node's choice and why in the one verdict every rank raises."""
    timeout_s = 30
    args = [*PP4, "--set", f"comm.timeout_s={timeout_s}"]
    named = ["--set", "comm.socket_ifname=xfdecoy"]
    codes, logs, ends = run_two_nodes(nodes, tmp_path, "decoy", args, node_args=(named, ()))
    assert codes[0] != 0 and codes[1] != 0
    # Everything, torch's import and the rendezvous included, ends before gloo would even have given up.
    assert max(ends) < timeout_s, ends
    reports = parse_reports("".join(logs))
    assert sorted(reports) == [0, 1, 2, 3], "\n".join(log[-3000:] for log in logs)
    texts = {re.sub(r"^rank \d+ ", "", text) for _, text in reports.values()}
    assert len(texts) == 1, texts  # the same text on every rank
    text = texts.pop()
    chosen = {0: "comm.socket_ifname=xfdecoy", 1: "host name '[^']+' resolves to it; comm.socket_ifname unset"}
    for node, peer_node in ((0, 1), (1, 0)):
        assert re.search(
            rf"node {node} \(ranks \d, \d\) would listen on xfdecoy {re.escape(DECOY_ADDRESSES[node])} "
            rf"\({chosen[node]}\), which node {peer_node} \(ranks \d, \d\) cannot reach \(Network is unreachable\); "
            rf"its interfaces that every other node reaches: xfnet {re.escape(NODE_ADDRESSES[node])}$",
            text,
            re.MULTILINE,
        ), text
    assert text.startswith("failed at start-up: ConfigError: comm.socket_ifname: the nodes cannot reach each other")
    assert "set comm.socket_ifname to an interface that works on every node, e.g. --set comm.socket_ifname=xfnet" in (
        text
    )
    assert "Connect timeout" not in "".join(logs)  # gloo never got to try


def test_doctor_peer_tells_which_interfaces_work_both_ways(nodes, tmp_path):
    listener = nodes.start(0, [sys.executable, "-m", "xfuse", "doctor", "--listen", "29411"], tmp_path / "listen.log")
    deadline = time.monotonic() + 60
    while "listening on port 29411" not in (tmp_path / "listen.log").read_text():
        assert listener.poll() is None and time.monotonic() < deadline, (tmp_path / "listen.log").read_text()
        time.sleep(0.2)
    peer = nodes.start(
        1,
        [sys.executable, "-m", "xfuse", "doctor", "--peer", f"{NODE_ADDRESSES[0]}:29411", "--timeout", "2"],
        tmp_path / "peer.log",
    )
    assert peer.wait(timeout=60) == 0, (tmp_path / "peer.log").read_text()
    report = (tmp_path / "peer.log").read_text()
    assert re.search(r"xfuse doctor on '[^']+' \(interfaces: .*xfnet 10\.231\.0\.1.*xfdecoy 10\.232\.0\.1", report)
    assert re.search(r"^  xfnet +10\.231\.0\.2 +reaches it \| reached$", report, re.MULTILINE), report
    assert re.search(r"^  xfdecoy +10\.232\.1\.1 +no \(.+\) \| no \(Network is unreachable\)$", report, re.M), report
    assert "works both ways: xfnet (" in report
    listener.terminate()
    assert listener.wait(timeout=30) == 0
    assert re.search(
        r"checked by .*: reached back: .*xfnet 10\.231\.0\.2 reached, xfdecoy 10\.232\.1\.1 no",
        (tmp_path / "listen.log").read_text(),
    )


def test_a_node_that_loses_its_link_strands_no_rank(nodes, tmp_path):
    timeout_s, steps = 5, 400
    args = [*PP4, "--set", "comm.socket_ifname=xfnet", "--set", f"comm.timeout_s={timeout_s}"]
    args += ["--set", f"generation.num_inference_steps={steps}", "-o", str(tmp_path / "never.png")]
    logs = [tmp_path / f"lost.node{n}.log" for n in (0, 1)]
    agents = [nodes.torchrun(n, "lost", ["generate", *TINY, *args], logs[n]) for n in (0, 1)]
    deadline = time.monotonic() + 120
    while not any(f"/{steps}" in log.read_text() for log in logs):  # denoising has begun (rank 0's progress bar)
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), logs[0].read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    nodes.set_link(0, up=False)
    fault_t = time.time()
    agents[0].wait(timeout=timeout_s + 60)
    # Node 1's ranks lost the rendezvous store with the link: they too must report and exit, nobody is stranded.
    deadline = time.monotonic() + timeout_s + 30
    while [pid for pid in nodes.marked_pids() if _is_worker(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in nodes.marked_pids() if _is_worker(pid)]  # every rank process of both nodes ended
    node0 = parse_reports(logs[0].read_text(), datetime.date.today())
    node1 = parse_reports(logs[1].read_text(), datetime.date.today())
    assert agents[0].returncode != 0
    assert len(node0) == 2 and len(node1) == 2 and not set(node0) & set(node1), (node0, node1)
    lost = sorted(node1)
    for rank, (when, text) in node0.items():
        assert when - fault_t < timeout_s + 5, (rank, when - fault_t, text)
        assert f"no heartbeat, no report (killed, or its node lost?): rank {lost[0]} (" in text, text
        assert f"rank {lost[1]} (" in text, text
    for rank, (when, text) in node1.items():
        assert when - fault_t < timeout_s + 10, (rank, when - fault_t, text)
        assert "the rendezvous store does not answer" in text, text
    nodes.kill_all()  # node 1's torchrun agent itself keeps retrying its rendezvous store (torch's own timeouts)
    nodes.set_link(0, up=True)


def _is_worker(pid: int) -> bool:
    """A torchrun worker (``python -u -m xfuse ...``), not an agent, and not a zombie."""
    try:
        status = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return status != "Z" and b"torch.distributed.run" not in cmdline and b"xfuse" in cmdline


def test_teardown_leaves_nothing_behind_also_when_the_test_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with TwoNodes(tag="xfnfail") as two:
            two.start(0, ["sleep", "600"], tmp_path / "sleep.log")
            assert two.leftovers()  # it did make things
            raise RuntimeError("the test failed")
    assert two.leftovers() == []
