"""A local Ray cluster for tests (started by the test session, stopped at its end) and the
process-table checks that a run leaves no Ray process behind."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass


@dataclass
class TestCluster:
    temp_dir: str  # every process of the cluster names it on its command line
    address: str


def start_cluster(num_cpus: int = 2) -> TestCluster:
    import ray

    # A short folder of our own: Ray's socket paths must stay short, and the process table is
    # searched for it to find this cluster's processes (and only them).
    temp_dir = tempfile.mkdtemp(prefix="nxray")
    # Ray waits 30 s for its GCS to start; on two cores shared by many jobs that was seen to run out.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _temp_dir=temp_dir)
    except BaseException:
        stop_cluster(TestCluster(temp_dir, ""))  # what did start stops; its folder goes
        raise
    return TestCluster(temp_dir, str(ray.get_runtime_context().gcs_address))


def stop_cluster(cluster: TestCluster) -> None:
    import ray

    ray.shutdown()
    leftover = wait_until_gone(lambda: processes_mentioning(cluster.temp_dir), 30)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    assert not leftover, f"Ray processes left after ray.shutdown(): {leftover}"


def process_table() -> dict[int, str]:
    """pid -> command line of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    continue  # a zombie is dead; its parent has not reaped it yet
        except OSError:
            continue
        if cmd:
            table[int(entry)] = cmd
    return table


def processes_mentioning(text: str) -> dict[int, str]:
    return {pid: cmd for pid, cmd in process_table().items() if text in cmd}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def wait_until_gone(probe, timeout: float):
    """Poll ``probe()`` until it is empty (returns it) or ``timeout`` seconds pass (returns what is left)."""
    deadline = time.monotonic() + timeout
    left = probe()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = probe()
    return left
