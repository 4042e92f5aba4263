"""The local Ray cluster ``nexrl run`` starts listens on loopback only (Ray's single-node mode:
Ray has no setting for the listening address, and replaces a loopback ``_node_ip_address`` with
the machine's); with ``ray.private_network: true`` the run and its cluster live in a network
namespace with only loopback, out of reach of every other process of the machine.

The tests look at the sockets themselves: every listening socket of the run's processes, and the
host namespace's table of listeners (what ``ss -ltn`` shows)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from nexrl_core.launch.ray.network import network_uses, probe
from nexrl_core.testing import write_recipe
from tests.reliability.helpers import NEXRL, REPO_ROOT
from tests.reliability.test_ray_processes import mock_recipe

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

REFUSED = probe()


def _listening_inodes(table_owner: int | str) -> dict[int, int]:
    """socket inode -> port of every TCP listener in the network namespace of ``table_owner``
    (a pid, or "self")."""
    found = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{table_owner}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # TCP_LISTEN
                found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _ray_processes(root: int) -> dict[int, str]:
    try:
        tree = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    names = {}
    for p in tree:
        try:
            names[p.pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    return names


def _wait_for_the_cluster(run, run_dir) -> dict[int, str]:
    """pid -> name of the run's processes once GCS, raylet and an actor's worker serve and training began."""
    seen: dict[int, str] = {}

    def cluster_serving() -> bool:
        seen.clear()
        seen.update(_ray_processes(run.proc.pid))
        names = set(seen.values())
        listening = [pid for pid, name in seen.items() if name == "gcs_server"
                     and _socket_inodes(pid) & set(_listening_inodes(pid))]
        return bool(listening) and "raylet" in names and any(n.startswith("ray::") for n in names) \
            and (run_dir / "metrics.jsonl").exists()

    run.wait_for(cluster_serving, timeout=240, poll=0.2)
    return dict(seen)


def _host_addresses() -> set[str]:
    return {"127.0.0.1"} | {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                            if a.family == socket.AF_INET}


def _refused_everywhere(ports: set[int], addresses: set[str]) -> None:
    for port in ports:
        for address in addresses:
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((address, port))


def test_the_local_cluster_listens_on_loopback_only(start_run, tmp_path):
    run_dir = tmp_path / "run"
    run = start_run(write_recipe(mock_recipe(run_dir), tmp_path / "recipe.yaml"))
    seen = _wait_for_the_cluster(run, run_dir)
    listeners = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in seen]
    assert {seen[c.pid] for c in listeners} >= {"gcs_server", "raylet"}, (listeners, seen)
    assert len({c.laddr.port for c in listeners}) >= 3  # GCS, raylet, workers at least
    assert {c.laddr.ip for c in listeners} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listeners
    # the machine's other addresses do not reach them
    _refused_everywhere({c.laddr.port for c in listeners}, _host_addresses() - {"127.0.0.1"})
    run.signal(signal.SIGTERM)
    assert run.wait(120) == 130, run.output()[-3000:]
    assert "ray: started a local cluster (2 CPUs) for this run, on loopback only" in run.output()


@pytest.mark.skipif(REFUSED is not None, reason=f"the kernel refuses network namespaces here: {REFUSED}")
def test_the_private_cluster_listens_inside_the_runs_namespace_only(start_run, tmp_path):
    run_dir = tmp_path / "run"
    recipe = mock_recipe(run_dir)
    recipe["ray"]["private_network"] = True
    run = start_run(write_recipe(recipe, tmp_path / "recipe.yaml"))
    seen = _wait_for_the_cluster(run, run_dir)
    host_ns = os.readlink("/proc/self/ns/net")
    gcs = next(pid for pid, name in seen.items() if name == "gcs_server")
    run_ns = os.readlink(f"/proc/{gcs}/ns/net")
    assert run_ns != host_ns
    # every process of the run (the driver included) shares that namespace
    namespaces = {pid: os.readlink(f"/proc/{pid}/ns/net") for pid in seen if os.path.exists(f"/proc/{pid}")}
    assert set(namespaces.values()) == {run_ns}, (namespaces, seen)
    # the run's listeners: in its namespace's table, none in the host's (what `ss -ltn` shows here)
    inside = _listening_inodes(gcs)
    run_listeners = {inode: port for pid in seen for inode in _socket_inodes(pid) if (port := inside.get(inode))}
    assert len(set(run_listeners.values())) >= 3, (run_listeners, seen)  # GCS, raylet, workers at least
    host = _listening_inodes("self")
    assert not set(run_listeners) & set(host)
    # and nothing of the host reaches them: loopback and the host's own address
    taken = set(host.values())  # another cluster on this machine may use the same number here
    _refused_everywhere(set(run_listeners.values()) - taken, _host_addresses())
    run.signal(signal.SIGTERM)
    assert run.wait(120) == 130, run.output()[-3000:]
    assert "ray: started a local cluster (2 CPUs) for this run, in a private network namespace" in run.output()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(NEXRL + list(args), cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)


def test_true_with_a_network_endpoint_is_refused_by_validate_and_run_alike(tmp_path):
    recipe = mock_recipe(tmp_path / "run")
    recipe["service"] = {"inference_service": {"backend": "openai", "url": "http://127.0.0.1:9/v1", "model": "m"}}
    recipe["ray"]["private_network"] = True
    path = write_recipe(recipe, tmp_path / "recipe.yaml")
    expected = ("error: ray.private_network: true cuts the run off the network, but "
                "service.inference_service.url is a URL (set ray.private_network: false)")
    validated, ran = _cli("validate", path), _cli("run", path)
    assert validated.returncode == ran.returncode == 2, (validated.stderr, ran.stderr)
    assert expected in validated.stderr.splitlines()
    assert expected in ran.stderr.splitlines()
    assert not (tmp_path / "run").exists()


def test_what_counts_as_needing_the_network(tmp_path, monkeypatch):
    from nexrl_core.builtins.sinks import WandbSink

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recipe = {"service": {"inference_service": {"tokenizer_path": "org/model", "model_path": str(tmp_path)}},
              "data": {"rows": [{"prompt": "see https://example.com"}]}, "logger": {"wandb": {"mode": "online"}}}
    assert network_uses(recipe, {}, [WandbSink]) == [
        "service.inference_service.tokenizer_path 'org/model' comes from the Hugging Face Hub (HF_HUB_OFFLINE=1 "
        "uses the cache)",
        "logger.backend: wandb online (logger.wandb.mode / WANDB_MODE)"]  # a URL inside a text is no endpoint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe["logger"]["wandb"]["mode"] = "offline"
    assert network_uses(recipe, {}, [WandbSink]) == []


def test_true_refuses_a_run_started_from_python(tmp_path):
    from nexrl_core import NexRLError
    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_core.plugins import get_plugin_manager

    recipe = mock_recipe(tmp_path / "run")
    recipe["ray"]["private_network"] = True
    config = load_recipe(write_recipe(recipe, tmp_path / "recipe.yaml"))
    with pytest.raises(NexRLError, match=r"^ray.private_network: true, but the run was not started by `nexrl run`"):
        NexRLController(config, plugin_manager=get_plugin_manager())
