"""Peak memory of a command and of every process it starts (the benchmarks that check ``nexrl plan``
against measured peaks: ``qwen3_shape_lora.py``, ``lora_fsdp_plan.py``).

Each process's peak is its resident high-water mark (``VmHWM`` in ``/proc/PID/status``: anonymous
and file-backed pages, the mmap'd safetensors a model may still read included), polled every 0.2 s
until the command exits: a process that lives less than that may be missed, a peak never is (the
kernel keeps the high-water mark)."""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Peaks:
    returncode: int
    output: str  # stdout and stderr together
    pid: int  # the command's own process
    bytes: dict[int, int] = field(default_factory=dict)  # pid -> peak resident bytes
    names: dict[int, str] = field(default_factory=dict)  # pid -> its command line (the first 160 characters)
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average as it started and as it ended

    @property
    def main(self) -> int:
        """The command's own process's peak."""
        return self.bytes.get(self.pid, 0)

    def largest_child(self) -> int:
        """The largest peak among the processes the command started (0: none seen)."""
        return max((v for p, v in self.bytes.items() if p != self.pid), default=0)


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        todo += [int(c) for c in children]
    return found


def _watch(pid: int, stop: threading.Event, peaks: Peaks) -> None:
    while not stop.is_set():
        for p in [pid, *descendants(pid)]:
            try:
                status = Path(f"/proc/{p}/status").read_text()
                peaks.names.setdefault(p, Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:160])
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks.bytes[p] = max(peaks.bytes.get(p, 0), int(line.split()[1]) * 1024)
        stop.wait(0.2)


def run_with_peaks(command: list[str], cwd: Path, env: dict[str, str]) -> Peaks:
    """Run ``command`` to its end, recording each process's peak resident memory."""
    load = os.getloadavg()[0]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = Peaks(returncode=0, output="", pid=proc.pid)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(proc.pid, stop, peaks), daemon=True)
    watcher.start()
    peaks.output = proc.communicate()[0]
    stop.set()
    watcher.join()
    peaks.returncode = proc.returncode
    peaks.load = (round(load, 1), round(os.getloadavg()[0], 1))
    return peaks
