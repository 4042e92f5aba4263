"""keep_freed_memory: memory torch frees is reused by the next step without page faults (glibc)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")

# A worker thread (as the trainer and the engine are) allocates, writes and frees 64 MiB six times;
# the minor page faults of the last three rounds are counted (the heap settles in the first two).
SCRIPT = """
import json, resource, sys, threading
import torch
from nexrl_torch.models import ModelSettings, apply_process_options

apply_process_options(ModelSettings.of(json.loads(sys.argv[1])))
faults = []

def work():
    for _ in range(6):
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        x = torch.ones(16 << 20)  # 64 MiB of float32, written
        del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(faults[-1] - faults[3])
"""
PAGES_64MIB = (64 << 20) // 4096


def _faults(section: dict) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(section)], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_freed_memory_is_reused_when_asked():
    # Opted in: once the heap has settled, no fresh pages are faulted in.
    assert _faults({"keep_freed_memory": True}) < PAGES_64MIB // 4


def test_by_default_the_process_allocator_is_left_as_it_is():
    # Process-wide tuning is an opt-in: without it glibc behaves as its own (each 64 MiB block a
    # fresh mapping, faulted in page by page).
    assert _faults({}) >= 3 * PAGES_64MIB * 9 // 10
    assert _faults({"keep_freed_memory": False}) >= 3 * PAGES_64MIB * 9 // 10
