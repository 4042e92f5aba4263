"""What the code sandbox costs per run, against starting the same interpreter bare.

For a trivial program (``print(input())``) this times, alternated round by round so machine load
hits every variant alike:

- ``bare``: ``subprocess.run([python, "-I", "-S", "-B", "-c", code])``, no isolation at all (the
  floor: one interpreter start per test case is unavoidable);
- ``namespaces``: ``Sandbox.run`` with Linux namespaces, 1 input and 10 inputs;
- ``rlimits``: the fallback, 1 input (only as root with an interpreter other uids can run).

Wall milliseconds are medians over the rounds; CPU milliseconds are the user+system time of this
process and of the processes a run started (less sensitive to other load on the machine). Overhead per run =
sandbox(1 input) - bare; per extra input = (sandbox(10) - sandbox(1)) / 9 - bare. Then
``--threads`` evaluations at once, to show parallel runs do not serialise.

    python benchmarks/sandbox_overhead.py [--rounds 30] [--threads 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

CODE = "print(input())"


def _cpu_ms() -> float:
    """CPU time of this process and of the processes it waited for (the launcher, the runners)."""
    return sum((u.ru_utime + u.ru_stime) * 1000 for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                          resource.getrusage(resource.RUSAGE_CHILDREN)))


def timed(fn) -> tuple[float, float]:
    cpu, start = _cpu_ms(), time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000, _cpu_ms() - cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)

    from nexrl_rewards.sandbox import Limits, Sandbox, base_interpreter

    python = base_interpreter()
    variants = {
        "bare": lambda: subprocess.run([python, "-I", "-S", "-B", "-c", CODE], input=b"x\n", capture_output=True,
                                       env={}, check=True),
    }
    ns = Sandbox(isolation="auto")
    if ns.mode == "namespaces":
        variants["namespaces x1"] = lambda: ns.run(CODE, ["x\n"])
        variants["namespaces x10"] = lambda: ns.run(CODE, ["x\n"] * 10)
    shared = next((c for c in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(c)), None)
    if os.geteuid() == 0 and shared:
        fb = Sandbox(python=os.path.realpath(shared), isolation="rlimits", limits=Limits())
        fb.run(CODE, ["x\n"])  # the one-time warning, out of the timings
        variants["rlimits x1"] = lambda: fb.run(CODE, ["x\n"])
    for fn in variants.values():
        fn()  # warm caches once
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn))
    print(f"python {python}, {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    med = {}
    for name, values in samples.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        med[name] = (wall, cpu)
        print(f"  {name:16s} wall {wall:7.1f} ms   cpu {cpu:6.1f} ms")
    if "namespaces x1" in med:
        bare, one, ten = med["bare"], med["namespaces x1"], med["namespaces x10"]
        print(f"namespaces: overhead per run {one[0] - bare[0]:.1f} ms wall / {one[1] - bare[1]:.1f} ms cpu; "
              f"per extra input {(ten[0] - one[0]) / 9 - bare[0]:.1f} ms wall / {(ten[1] - one[1]) / 9 - bare[1]:.1f}"
              f" ms cpu beyond a bare interpreter start")
    if "rlimits x1" in med:
        print(f"rlimits: overhead per run {med['rlimits x1'][0] - med['bare'][0]:.1f} ms wall")
    if "namespaces x1" in med and args.threads > 1:
        n = args.threads * 4
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda: [ns.run(CODE, ["x\n"]) for _ in range(4)])
                   for _ in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - start
        print(f"{args.threads} threads x 4 runs: {n / took:.1f} runs/s ({took * 1000 / n:.1f} ms per run; "
              f"{os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
