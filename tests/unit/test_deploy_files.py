"""The service files in ``examples/deploy/`` run what the one-command tests run (``tests/launch/test_launcher.py``:
SIGTERM drains and exits 0, a dead rank exits 1): their commands parse as ``xfuse serve``, their configs validate,
their probes are the server's routes, their signals and restarts are the ones the launcher answers. systemd and
Kubernetes themselves cannot run on this machine."""

import os
import shlex

import pytest
import yaml

from xfuse.cli import main
from xfuse.config import config_from_dict
from xfuse.serve.app import create_app
from xfuse.serve.metrics import ServeMetrics
from xfuse.serve.service import Service

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples/deploy")


def _unit() -> dict[str, str]:
    entries = {}
    with open(os.path.join(DEPLOY, "xfuse.service")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")) and "=" in line:
                key, value = line.split("=", 1)
                entries[key] = value
    return entries


def _kubernetes() -> dict[str, dict]:
    with open(os.path.join(DEPLOY, "kubernetes.yaml")) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def _routes() -> set[str]:
    service = Service(world_size=1, metrics=ServeMetrics(world_size=1, info={}), max_queue=1, request_timeout_s=1.0,
                      heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0)  # fmt: skip
    return {route.path for route in create_app(service, api_key=None, max_body_bytes=1024).routes}


def _parses_as_serve(argv: list[str], monkeypatch) -> None:
    """The command line is one the xfuse CLI takes (its subcommand function replaced: nothing starts)."""
    import xfuse.cli

    seen = []
    monkeypatch.setattr(xfuse.cli, "cmd_serve", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(xfuse.cli, "_ranks_to_start", lambda args: 0)
    assert main(argv) == 0 and len(seen) == 1 and seen[0].port == 8000 and seen[0].host == "0.0.0.0"


def test_the_systemd_unit_stops_with_sigterm_to_the_command_and_restarts_a_failed_world(monkeypatch):
    unit = _unit()
    command = shlex.split(unit["ExecStart"])
    assert os.path.basename(command[0]) == "xfuse" and command[1] == "serve"
    _parses_as_serve(command[1:], monkeypatch)
    assert unit["KillSignal"] == "SIGTERM" and unit["KillMode"] == "mixed"  # the command forwards it to its ranks
    assert unit["Restart"] == "on-failure" and int(unit["TimeoutStopSec"]) >= 60


def test_the_kubernetes_deployment_probes_routes_and_runs_the_configs_world(monkeypatch):
    docs = _kubernetes()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["xfuse", "serve"]
    _parses_as_serve(container["command"][1:], monkeypatch)
    routes = _routes()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/live" in routes
    assert pod["terminationGracePeriodSeconds"] >= 60
    config = config_from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["serve.yaml"]))
    assert config.world_size == container["resources"]["limits"]["nvidia.com/gpu"]  # the ranks it starts


@pytest.mark.parametrize("name", ["xfuse.service", "kubernetes.yaml"])
def test_the_files_name_the_one_command_not_torchrun(name):
    with open(os.path.join(DEPLOY, name)) as f:
        assert "torchrun" not in f.read()
