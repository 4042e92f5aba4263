"""Does the ``--quick`` guard flag a deliberate slowdown? (issue 48: "the guard flags a deliberate 20%
slowdown on a machine that is not the reference").

Each pair runs ``grpo_vs_trl.py --quick`` twice, each in a fresh process:

1. as shipped (nothing patched): its exit status, ratio and nexrl seconds per step;
2. with a sleep patched into the engine's decode step (every ``session.step`` of
   ``nexrl_torch.rollout.decoding``, from this script's child mode, before ``grpo_vs_trl.main``
   runs), sized so that it adds ``--slowdown`` (0.2) of run 1's nexrl step time to every nexrl
   step. TRL is not touched, so the ratio nexrl/TRL should fall by 1 - 1/(1 + slowdown) (16.7%).

How many decode steps a nexrl step makes is known only after a patched run: the first pair
assumes ``--max-new-tokens`` (48, one engine batch per step), every later pair uses the count the
pair before measured. What the patch actually added is counted and printed either way.

Before each run the script waits (up to ``--settle-s``) for the 1-minute load average to fall
below 1: the guard calls a machine busy, and widens its threshold from 10% to 40%, when the load
before the run is 1 or more, and the run before would otherwise count as "other jobs".

    python benchmarks/guard_slowdown.py --pairs 2 --out benchmarks/results/guard_slowdown.json

Nothing here is product code: the patch exists only in the child process this script starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GRPO_VS_TRL = os.path.join(HERE, "grpo_vs_trl.py")


def slow_decode_steps(sleep_s: float, patch: Any = setattr) -> list[int]:
    """Sleep ``sleep_s`` after every decode step of the engine (``step`` of each session class of
    ``nexrl_torch.rollout.decoding``, patched with ``patch``); the returned list's one item counts
    the steps."""
    from nexrl_torch.rollout import decoding

    calls = [0]

    def slowed(step: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = step(self, *args, **kwargs)
            calls[0] += 1
            time.sleep(sleep_s)
            return out
        return wrapper

    for cls in (decoding.HFSession, decoding.FastLlamaSession, decoding.StaticSession):
        if "step" in vars(cls):
            patch(cls, "step", slowed(vars(cls)["step"]))
    return calls


def child(sleep_s: float, counts_path: str, argv: list[str]) -> int:
    """``grpo_vs_trl.main(argv)`` with ``sleep_s`` slept after every decode step of the engine."""
    import grpo_vs_trl

    calls = slow_decode_steps(sleep_s)
    status = grpo_vs_trl.main(argv)
    with open(counts_path, "w") as f:
        json.dump({"decode_steps": calls[0], "sleep_s": sleep_s}, f)
    return status


def load1() -> float:
    return os.getloadavg()[0]


def settle(limit_s: float) -> tuple[float, float]:
    """Wait until the 1-minute load average is below 1 (at most ``limit_s``): seconds waited, load."""
    started = time.monotonic()
    while load1() >= 1.0 and time.monotonic() - started < limit_s:
        time.sleep(10)
    return round(time.monotonic() - started), round(load1(), 2)


def run(argv: list[str], label: str) -> dict[str, Any]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=os.path.dirname(HERE))
    out = proc.stdout + proc.stderr
    print(f"--- {label}: exit {proc.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    tail = [line for line in out.splitlines() if line.startswith(("block ", "ratio ", "other jobs", "against ",
                                                                    "  nexrl", "  not judged", "  judged", "guard "))]
    print("\n".join(tail), flush=True)
    return {"exit": proc.returncode, "seconds": round(time.monotonic() - started), "lines": tail,
            "output_tail": out.splitlines()[-60:]}


def nexrl_s_per_step(result: dict[str, Any]) -> float:
    times = next(t for name, t in result["times"].items() if name.startswith("nexrl"))
    return sum(times) / (len(times) * result["args"]["steps_per_block"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=0.2, help="added time as a fraction of the unpatched nexrl step")
    p.add_argument("--max-new-tokens", type=int, default=48, help="the first pair's guess of decode steps per step")
    p.add_argument("--settle-s", type=float, default=240, help="longest wait for the load to fall below 1")
    p.add_argument("--out", help="write every run's figures to this JSON file")
    p.add_argument("--child", nargs=2, metavar=("SLEEP_S", "COUNTS"), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.child:
        sys.path.insert(0, HERE)
        return child(float(args.child[0]), args.child[1], rest)

    decode_steps_per_step = float(args.max_new_tokens)
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="guard-slowdown-") as tmp:
        for i in range(args.pairs):
            pair: dict[str, Any] = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
            plain_json, slow_json, counts = (os.path.join(tmp, f"{name}-{i}.json") for name in ("plain", "slow", "n"))
            pair["plain_settle"] = settle(args.settle_s)
            pair["plain"] = run([GRPO_VS_TRL, "--quick", "--json", plain_json], f"pair {i + 1}, as shipped")
            pairs.append(pair)
            write(args.out, args.slowdown, pairs)
            if not os.path.exists(plain_json):  # killed (the OOM killer, on a crowded machine): no figures
                continue
            with open(plain_json) as f:
                plain = json.load(f)
            s_plain = nexrl_s_per_step(plain)
            sleep_s = args.slowdown * s_plain / decode_steps_per_step
            pair["sleep_s"] = round(sleep_s, 5)
            pair["slow_settle"] = settle(args.settle_s)
            pair["slowed"] = run([os.path.abspath(__file__), "--child", str(sleep_s), counts, "--quick",
                                  "--json", slow_json], f"pair {i + 1}, {sleep_s * 1e3:.1f} ms slept per decode step")
            write(args.out, args.slowdown, pairs)  # a run that died keeps its output tail
            if not os.path.exists(slow_json):
                continue
            with open(slow_json) as f:
                slow = json.load(f)
            with open(counts) as f:
                counted = json.load(f)
            steps = slow["args"]["warmup"] + slow["args"]["blocks"] * slow["args"]["steps_per_block"]
            decode_steps_per_step = counted["decode_steps"] / steps
            added = decode_steps_per_step * sleep_s
            ratio_plain, ratio_slow = (next(iter(r["ratios"].values())) for r in (plain, slow))
            pair.update(
                nexrl_s_per_step={"plain": round(s_plain, 3), "slowed": round(nexrl_s_per_step(slow), 3)},
                decode_steps_per_nexrl_step=round(decode_steps_per_step, 1),
                added_s_per_step=round(added, 3), added_fraction=round(added / s_plain, 3),
                ratio={"plain": round(ratio_plain, 3), "slowed": round(ratio_slow, 3)},
                ratio_change_slowed_vs_plain=round(ratio_slow / ratio_plain - 1, 3),
                other_load={"plain": plain["other_load"], "slowed": slow["other_load"]},
                cpu=plain["cpu"])
            print(f"pair {i + 1}: as shipped exit {pair['plain']['exit']}, slowed exit {pair['slowed']['exit']}; "
                  f"added {added:.2f} s a step ({added / s_plain:.1%} of {s_plain:.2f} s, "
                  f"{decode_steps_per_step:.1f} decode steps a step); ratio {ratio_plain:.2f}x -> {ratio_slow:.2f}x "
                  f"({ratio_slow / ratio_plain - 1:+.1%}); other load {plain['other_load']} / {slow['other_load']}",
                  flush=True)
            write(args.out, args.slowdown, pairs)
    flagged = sum(p.get("slowed", {}).get("exit") == 1 for p in pairs)
    clean = sum(p["plain"]["exit"] == 0 for p in pairs)
    print(f"slowed runs flagged: {flagged} of {len(pairs)}; runs as shipped passing: {clean} of {len(pairs)}")
    return 0 if flagged == clean == len(pairs) else 1


def write(path: str | None, slowdown: float, pairs: list[dict[str, Any]]) -> None:
    """Every run so far, after each run (a run that dies, or a script stopped later, loses nothing)."""
    if path:
        with open(path, "w") as f:
            json.dump({"slowdown": slowdown, "pairs": pairs}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
