"""Framework overhead of nexrl.

Part 1 (``--part flow``): trajectories/s through the real local-mode data path
(data loader -> rollout worker threads -> trajectory pool -> trainer -> weight sync) driven by
``NexRLController``, with the ``mock`` inference backend (answers instantly) and the ``mock``
trainer (trains nothing). Everything measured is framework code. Target: >= 5,000 trajectories/s.

Part 2 (``--part step``): where the wall time of a real quickstart step goes (SmolLM2-135M on
the CPU): generation, old-logprob/prep, forward_backward, optim_step, weight sync, checkpoint
and the rest (framework). It wraps the real components' methods with timers (no code change),
runs ``recipes/quickstart.yaml`` for a few steps through ``NexRLController`` and prints the
``timing/*`` rows of metrics.jsonl too; ``--py-spy FILE`` also samples the run with py-spy.
Target: framework <= 2% of the step.

Part 3 (``--part pack``): fwd+bwd of one GRPO batch two ways: full padded rows (as TRL does)
and nexrl's packed forward (``compute_response_logprobs_packed``, no padding, each prompt once).

Part 4 (``--part ray``): part 1's data path in ``launch_mode: ray`` against local mode, measured
alternately in one run on one local Ray cluster: the rollout workers in 1, 2 and 4 actors (the
control plane in one actor, the mock trainer and engine in another). Target: >= 1,000
trajectories/s in Ray mode.

Part 5 (``--part ray-step``): the quickstart's s/step in Ray mode (trainer and engine in one
actor, the default; and apart, so every weight push crosses processes through the object store)
against local mode, alternately in one run, with the weight-sync time of each. Target: Ray <= 1.1x
local.

    python benchmarks/overhead.py                      # all parts (~6 min on 2 CPU cores)
    python benchmarks/overhead.py --part flow --workers 4 16 --batches 64
    python benchmarks/overhead.py --part step --real-steps 3 --py-spy /tmp/step.txt
    python benchmarks/overhead.py --part flow --profile flow.prof   # cProfile of one flow config
    python benchmarks/overhead.py --part ray --workers 16 --batches 256 --tasks-per-call 16
    python benchmarks/overhead.py --part ray-step --real-steps 4 --reps 2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "recipes", "quickstart.yaml")

FLOW_RECIPE = """\
launch_mode: {launch_mode}
project_name: nexrl-bench
experiment_name: overhead
run_dir: {run_dir}
seed: 1
data:
  type: arithmetic
  num_rows: 4000
  max_value: 99
rollout_worker:
  type: simple
  num_workers: {workers}
  num_actors: {actors}
  tasks_per_call: {tasks_per_call}
  sampling: {{max_tokens: 16}}
  evaluator: {{type: numeric_answer}}
trajectory_pool:
  batch_size: {batch}
  group_size: {group}
  key_list: [uid]
trainer:
  type: mock
  total_train_steps: {steps}
  save_freq: 0
  save_final: false
weight:
  sync_mode: {sync_mode}
  staleness_threshold: {staleness}
  rollout_limit: {limit}
  backend: version_only
service:
  inference_service: {{backend: mock, mode: sum}}
logger:
  backend: []
  level: WARNING
"""


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _quiet_logs() -> None:
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)


# ----------------------------------------------------------------------------- part 1: flow


def run_flow(workers: int, batch: int, group: int, steps: int, sync_mode: str = "sync",
             staleness: int = 0, profile: str | None = None, limit: str = "null", launch_mode: str = "local",
             actors: int = 1, tasks_per_call: int = 1) -> dict[str, float]:
    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_core.runtime.execute import execute

    with tempfile.TemporaryDirectory(prefix="nexrl-overhead-") as tmp:
        path = os.path.join(tmp, "recipe.yaml")
        with open(path, "w") as f:
            f.write(FLOW_RECIPE.format(run_dir=os.path.join(tmp, "run"), workers=workers, batch=batch, group=group,
                                       steps=steps, sync_mode=sync_mode, staleness=staleness, limit=limit,
                                       launch_mode=launch_mode, actors=actors, tasks_per_call=tasks_per_call))
        cfg = load_recipe(path)
        controller = NexRLController(cfg)  # (Ray: the actors start here, outside the timed run)
        read: dict[str, Any] = {}
        release = controller.resource_manager.shutdown

        def read_then_release() -> None:  # modules are reached through their handles in any launch mode
            read["cpu"] = cpu_since(cpu0)
            read["n"] = sum(len(b) for b in execute(controller.trainer.get_batches))
            read["rerolled"] = execute(controller.trajectory_pool.counters).get("stale_rerolled", 0)
            read["calls"] = execute(controller.inference_client.num_calls)
            release()

        controller.resource_manager.shutdown = read_then_release
        t0, cpu0 = time.perf_counter(), tree_cpu_s()
        if profile:
            summary = _run_profiled(controller, profile)
        else:
            summary = controller.run()
        wall = time.perf_counter() - t0
    assert summary.stopped_by == "finished", summary
    n = read["n"]
    return {"workers": workers, "batch": batch, "group": group, "steps": steps, "sync_mode": sync_mode,
            "trajectories": n, "wall_s": wall, "traj_per_s": n / wall, "steps_per_s": steps / wall,
            "generated": read["calls"], "stale_rerolled": read["rerolled"], "launch_mode": launch_mode,
            "cpu_ms_per_traj": 1000 * read["cpu"] / max(n, 1),
            "actors": actors, "tasks_per_call": tasks_per_call}


def _run_profiled(controller: Any, out: str) -> Any:
    """Run with cProfile enabled in every thread the run starts (stats merged into ``out``)."""
    import cProfile
    import pstats

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    orig_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        p = cProfile.Profile()
        with lock:
            profiles.append(p)
        p.enable()
        try:
            orig_run(self)
        finally:
            p.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    main = cProfile.Profile()
    main.enable()
    try:
        summary = controller.run()
    finally:
        main.disable()
        threading.Thread.run = orig_run  # type: ignore[method-assign]
    stats = pstats.Stats(main)
    for p in profiles:
        with contextlib.suppress(TypeError):
            stats.add(p)
    stats.dump_stats(out)
    stats.sort_stats("tottime").print_stats(25)
    return summary


def part_flow(args: argparse.Namespace) -> list[dict[str, float]]:
    _quiet_logs()
    configs = [(w, b) for w in args.workers for b in args.batches]
    print(f"== part 1: framework data path with mock inference + mock trainer, weight.rollout_limit="
          f"{args.flow_rollout_limit} (load avg {loadavg()})")
    print(f"{'workers':>7} {'batch':>5} {'group':>5} {'mode':>11} {'steps':>5} {'traj':>7} {'wall_s':>7} "
          f"{'traj/s':>8} {'steps/s':>7} {'generated':>9} {'rerolled':>8}")
    results = []
    for mode in args.modes:
        for w, b in configs:
            steps = args.steps or max(10, args.trajectories // b)
            r = run_flow(w, b, args.group, steps, mode, 1 if mode != "sync" else 0,
                         args.profile if args.profile and not results else None,
                         args.flow_rollout_limit if mode == "sync" else "batch")  # the limit is sync mode's
            results.append(r)
            print(f"{r['workers']:>7} {r['batch']:>5} {r['group']:>5} {mode:>11} {r['steps']:>5} "
                  f"{r['trajectories']:>7} {r['wall_s']:>7.2f} {r['traj_per_s']:>8.0f} {r['steps_per_s']:>7.1f} "
                  f"{r['generated']:>9} {r['stale_rerolled']:>8}", flush=True)
    best = max(results, key=lambda r: r["traj_per_s"])
    print(f"best: {best['traj_per_s']:.0f} trajectories/s (workers={best['workers']}, batch={best['batch']}, "
          f"{best['sync_mode']}); target >= 5000; load avg {loadavg()}")
    return results


# ----------------------------------------------------------------------------- part 4: ray flow


def tree_cpu_s(root: int | None = None) -> dict[int, float]:
    """CPU seconds (user + system) used so far by process ``root`` (this one) and by each of its
    descendants (with Ray: the raylet, the GCS and the actors' workers), by pid."""
    root = os.getpid() if root is None else root
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
        todo += children.get(pid, [])
    return out


def cpu_since(before: dict[int, float]) -> float:
    """CPU seconds the process tree used since ``before`` (processes alive now)."""
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in tree_cpu_s().items())


def _start_ray(num_cpus: int | None) -> None:
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)


def part_ray(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 1's data path, local vs Ray with the workers in 1, 2, 4 actors, alternated per repetition."""
    import ray

    _quiet_logs()
    os.environ.setdefault("NEXRL_LOAD_PLUGINS", "")  # the mock components are built in; nothing else to load
    _start_ray(args.ray_cpus)
    print(f"== part 4: data path, local (tasks_per_call 1) vs ray (tasks_per_call {args.tasks_per_call}), "
          f"mock engine + mock trainer "
          f"(ray: {ray.cluster_resources().get('CPU', 0):g} CPUs; load avg {loadavg()})")
    print(f"{'mode':>6} {'actors':>6} {'workers':>7} {'batch':>5} {'steps':>5} {'traj':>7} {'wall_s':>7} "
          f"{'traj/s':>8} {'steps/s':>7} {'rerolled':>8} {'cpu ms/traj':>11}")
    variants = [("local", 1)] + [("ray", a) for a in args.actors]
    results: list[dict[str, Any]] = []
    try:
        for _ in range(args.reps):
            for w in args.workers:
                for b in args.batches:
                    steps = args.steps or max(10, args.trajectories // b)
                    for mode, actors in variants:
                        r = run_flow(w, b, args.group, steps, "sync", 0, None, args.flow_rollout_limit, mode,
                                     min(actors, w), args.tasks_per_call if mode == "ray" else 1)
                        results.append(r)
                        print(f"{mode:>6} {r['actors'] if mode == 'ray' else '-':>6} {w:>7} {b:>5} {steps:>5} "
                              f"{r['trajectories']:>7} {r['wall_s']:>7.2f} {r['traj_per_s']:>8.0f} "
                              f"{r['steps_per_s']:>7.1f} {r['stale_rerolled']:>8} {r['cpu_ms_per_traj']:>11.3f}",
                              flush=True)
    finally:
        ray.shutdown()
    for mode, actors in variants:
        mine = [r for r in results if r["launch_mode"] == mode and (mode == "local" or r["actors"] == actors)]
        best = max(mine, key=lambda r: r["traj_per_s"])
        label = "local" if mode == "local" else f"ray, workers in {actors} actor(s)"
        cpu = min(r["cpu_ms_per_traj"] for r in mine)
        print(f"best {label}: {best['traj_per_s']:.0f} trajectories/s (workers={best['workers']}, "
              f"batch={best['batch']}); {cpu:.3f} CPU-ms per trajectory over all its processes "
              f"(2 idle cores: at most {2000 / cpu:.0f} trajectories/s)")
    print(f"target: ray >= 1000 trajectories/s; load avg {loadavg()}")
    return results


# ----------------------------------------------------------------------------- part 5: ray step


def _watch_steps(run_dir: str, stop: threading.Event, marks: list[float]) -> None:
    """Arrival time of each training row of metrics.jsonl (how a step's end is seen in any launch mode)."""
    path, seen = os.path.join(run_dir, "metrics.jsonl"), 0
    while not stop.is_set():
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            n = sum("train/reward_mean" in r for r in rows)
            marks.extend([time.perf_counter()] * (n - seen))
            seen = n
        stop.wait(0.05)


def run_quickstart(tmp: str, mode: str, steps: int, extra: list[str]) -> dict[str, Any]:
    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe

    run_dir = os.path.join(tmp, f"{mode}-{time.monotonic_ns()}")
    overrides = [f"run_dir={run_dir}", f"trainer.total_train_steps={steps}", "trainer.save_freq=0", "trainer.save_final=false",
                 "validate.validate_before_train=false", "weight.validate_freq=0", "logger.backend=[]",
                 f"launch_mode={'local' if mode == 'local' else 'ray'}"]
    if mode == "ray-apart":
        overrides.append("ray.colocation.trainer=null")  # trainer in an actor of its own: pushes cross processes
    controller = NexRLController(load_recipe(QUICKSTART, overrides + extra))
    marks: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_steps, args=(run_dir, stop, marks), daemon=True)
    watcher.start()
    summary = controller.run()
    stop.set()
    watcher.join()
    _watch_steps_final(run_dir, marks)
    assert summary.stopped_by == "finished", summary
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    syncs = [r["timing/weight_sync_s"] for r in rows if "timing/weight_sync_s" in r][1:]
    span = marks[-1] - marks[0]
    return {"mode": mode, "s_per_step": span / max(len(marks) - 1, 1), "steps": len(marks),
            "weight_sync_s": sum(syncs) / len(syncs) if syncs else float("nan")}


def _watch_steps_final(run_dir: str, marks: list[float]) -> None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        n = sum("train/reward_mean" in json.loads(line) for line in f if line.strip())
    marks.extend([time.perf_counter()] * (n - len(marks)))


def part_ray_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray

    _quiet_logs()
    os.environ.setdefault("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
    _start_ray(args.ray_cpus)
    modes = ["local", "ray", "ray-apart"]
    print(f"== part 5: quickstart s/step, local vs ray, alternately ({args.real_steps} steps a run, "
          f"{args.reps} runs each; load avg {loadavg()})")
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="nexrl-raystep-") as tmp:
            for _ in range(args.reps):
                for mode in modes:
                    r = run_quickstart(tmp, mode, args.real_steps, list(args.override))
                    results.append(r)
                    print(f"  {mode:<10} {r['s_per_step']:7.2f} s/step over steps 2..{r['steps']}  "
                          f"weight sync {r['weight_sync_s']:.3f} s  (load avg {loadavg()})", flush=True)
    finally:
        ray.shutdown()
    mean = {m: sum(r["s_per_step"] for r in results if r["mode"] == m) / args.reps for m in modes}
    sync = {m: sum(r["weight_sync_s"] for r in results if r["mode"] == m) / args.reps for m in modes}
    for m in modes:
        print(f"{m:<10} {mean[m]:7.2f} s/step  {mean[m] / mean['local']:5.2f}x local  weight sync {sync[m]:.3f} s")
    print("target: ray <= 1.1x local")
    return results


# ----------------------------------------------------------------------------- part 2: real step


class Timers:
    """Accumulates wall time per (thread-agnostic) label; wraps bound methods in place."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                with self.lock:
                    self.total[label] += t1 - t0
                    self.count[label] += 1
                    self.intervals[label].append((t0, t1))

        setattr(obj, name, timed)


def part_step(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe

    _quiet_logs()
    print(f"== part 2: real quickstart steps, broken down (torch threads {torch.get_num_threads()}, "
          f"load avg {loadavg()})")
    with tempfile.TemporaryDirectory(prefix="nexrl-step-") as tmp:
        overrides = [f"run_dir={tmp}/run", f"trainer.total_train_steps={args.real_steps}",
                     f"trainer.save_freq={args.save_freq}", "validate.validate_before_train=false",
                     "weight.validate_freq=0", "logger.backend=[]",
                     f"rollout_worker.sampling.max_tokens={args.max_tokens}"]
        if args.rollout_limit != "recipe":
            overrides.append(f"weight.rollout_limit={args.rollout_limit}")
        overrides += list(args.override)
        print(f"   recipes/quickstart.yaml + {' '.join(o for o in overrides if not o.startswith('run_dir'))}")
        cfg = load_recipe(QUICKSTART, overrides)
        controller = NexRLController(cfg)
        timers = Timers()
        trainer, engine = controller.trainer, controller.inference_client
        ws = controller.weight_sync_controller
        timers.wrap(engine, "_generate", "generation")
        timers.wrap(trainer, "_process_trajectories", "prep")
        timers.wrap(trainer, "_prepare_batch", "prep")
        timers.wrap(trainer, "save_checkpoint", "checkpoint")
        timers.wrap(ws, "sync_weight_to_rollout_service", "weight sync")
        orig_init = trainer.initialize_workers

        def init_and_wrap() -> None:
            orig_init()
            svc = trainer.train_service
            timers.wrap(svc, "forward_backward", "forward_backward")
            timers.wrap(svc, "optim_step", "optim_step")

        trainer.initialize_workers = init_and_wrap
        # A step ends when the trainer has pushed its weights (the next rollouts may start).
        step_marks: list[float] = []
        orig_update = ws.train_worker_notify_weight_update

        def mark(*a: Any, **k: Any) -> Any:
            out = orig_update(*a, **k)
            step_marks.append(time.perf_counter())
            return out

        ws.train_worker_notify_weight_update = mark
        t_start = time.perf_counter()
        spy = _start_py_spy(args.py_spy) if args.py_spy else None
        prof_ctx = _torch_profiler(args.torch_profile) if args.torch_profile else contextlib.nullcontext()
        with prof_ctx:
            summary = controller.run()
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
        t_end = time.perf_counter()
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    assert summary.stopped_by == "finished", summary
    # Steady state: from the end of step 1 to the end of the last step (step 1 includes warm-up).
    first = 1 if len(step_marks) > 1 else 0
    w0 = step_marks[first - 1] if first else t_start
    w1 = step_marks[-1]
    span, n_steps = w1 - w0, len(step_marks) - first

    def in_window(label: str) -> float:
        return sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in timers.intervals.get(label, []))

    names = ["generation", "prep", "forward_backward", "optim_step", "weight sync", "checkpoint"]
    parts = {name: in_window(name) for name in names}
    # Phases run one after another in sync mode with weight.rollout_limit=batch; without the limit,
    # discarded extra rollouts overlap training and "generation" double-counts that time.
    parts["framework/other"] = span - sum(parts.values())
    labels = {"prep": "old-logprob/prep", "framework/other": "framework/other"}
    print(f"steps {first + 1}..{len(step_marks)}: {span:.2f}s over {n_steps} step(s) = "
          f"{span / max(n_steps, 1):.2f} s/step (whole run incl. model load {t_end - t_start:.1f}s)")
    for name, sec in parts.items():
        print(f"  {labels.get(name, name):<18} {sec / max(n_steps, 1):8.3f} s/step  {100 * sec / span:6.2f} %")
    print("  timing/* from metrics.jsonl:")
    for r in rows:
        if "timing/train_s" in r:
            shown = {k.split("/", 1)[1]: round(v, 3) for k, v in sorted(r.items()) if k.startswith("timing/")}
            print(f"    step {r['step']}: {shown}  reward_mean={r.get('train/reward_mean'):.3f} "
                  f"response_length_mean={r.get('train/response_length_mean', 0):.1f} "
                  f"stale_rerolled={r.get('pool/stale_rerolled')}")
    print(f"  engine: {engine.num_batches} batches, {engine.num_requests} requests for "
          f"{len(step_marks) * int(cfg.trajectory_pool.batch_size)} trained trajectories")
    pct = 100 * parts["framework/other"] / span
    print(f"framework/other = {pct:.2f}% of step time (target <= 2%); load avg {loadavg()}")
    if args.py_spy:
        summarize_py_spy(args.py_spy)
    return {"span": span, "parts": parts, "framework_pct": pct}


def _start_py_spy(out: str):
    import shutil
    import subprocess

    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy needs py-spy (pip install -r benchmarks/requirements.txt)")
    proc = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--rate", "50", "--format", "raw",
                             "--threads", "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc


_PHASES = [  # first match (innermost-last order of the stack is not needed: any frame matches)
    ("generation", ("HFInferenceEngine._generate",)),
    ("forward_backward", ("LocalTorchTrainService.forward_backward",)),
    ("optim_step", ("LocalTorchTrainService.optim_step",)),
    ("checkpoint", ("BaseTrainer.save_checkpoint",)),
    ("weight sync", ("WeightSyncController.sync_weight_to_rollout_service",)),
    ("old-logprob/prep", ("SelfHostedTrainer._process_trajectories", "SelfHostedGrpoTrainer._prepare_batch")),
    ("model load", ("load_causal_lm", "initialize_workers", "HFInferenceBackend.__init__")),
]


_IDLE_LEAVES = {"Condition.wait", "Event.wait", "Queue.get", "Thread.join", "time.sleep",
                "Thread._wait_for_tstate_lock"}


def summarize_py_spy(path: str, top: int = 25) -> None:
    """Samples of a ``py-spy record --format raw --threads`` file, by phase and by function."""
    import re

    phases: dict[str, int] = defaultdict(int)
    funcs: dict[str, int] = defaultdict(int)
    total = 0
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, n_text = line.rsplit(" ", 1)
        n = int(n_text)
        frames = [re.sub(r" \((.*?):\d+\)", r" (\1)", f) for f in stack.split(";")[1:]]
        if not frames or any("_start_py_spy" in f for f in frames) or frames[-1].split(" ")[0] in _IDLE_LEAVES:
            continue  # py-spy's own start-up, and threads blocked on a lock/condition (not working)
        total += n
        phase = next((name for name, keys in _PHASES if any(k in f for f in frames for k in keys)), "framework/other")
        phases[phase] += n
        if frames:
            funcs[frames[-1]] += n
    print(f"  py-spy: {total} samples (50/s, threads not blocked on a lock), by phase:")
    for name, n in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<18} {100 * n / max(total, 1):6.2f} %")
    print(f"  top {top} functions by own samples:")
    for name, n in sorted(funcs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {100 * n / max(total, 1):6.2f} %  {name}")


# ----------------------------------------------------------------------------- part 3: packing


def part_pack(args: argparse.Namespace) -> None:
    """fwd+bwd of one GRPO batch (4 prompts x 4 responses of mixed length, SmolLM2): full padded rows
    (what TRL computes) and the packed forward (nexrl's default)."""
    import random

    import torch

    from nexrl_torch.logprobs import compute_response_logprobs, compute_response_logprobs_packed, position_ids_from_mask
    from nexrl_torch.models import load_causal_lm, resolve_model_path

    _quiet_logs()
    model, tok = load_causal_lm(resolve_model_path("smollm2-135m-instruct"))
    model.train()
    rng = random.Random(0)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                                     add_generation_prompt=True, tokenize=False) for a, b in [(3, 4), (12, 9), (7, 15), (20, 1)]]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    lengths = args.pack_lengths
    responses = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    group_of = [i * len(prompts) // len(lengths) for i in range(len(lengths))]
    rows, max_p, max_r = len(lengths), max(map(len, prompts)), max(lengths)
    ids = torch.full((rows, max_p + max_r), tok.pad_token_id)
    am = torch.zeros_like(ids)
    rmask = torch.zeros(rows, max_r)
    for i in range(rows):
        p, r = prompts[group_of[i]], responses[i]
        ids[i, max_p - len(p):max_p], am[i, max_p - len(p):max_p] = torch.tensor(p), 1
        ids[i, max_p:max_p + len(r)], am[i, max_p:max_p + len(r)] = torch.tensor(r), 1
        rmask[i, :len(r)] = 1
    pid = position_ids_from_mask(am)
    groups = torch.tensor(group_of)
    with torch.no_grad():
        ref = compute_response_logprobs(model, ids, am, pid, max_r)
        packed = compute_response_logprobs_packed(model, ids, am, pid, max_r, groups)
    diff = float(((ref - packed) * rmask).abs().max())
    print(f"== part 3: fwd+bwd of one batch, {rows} responses of lengths {lengths} (load avg {loadavg()})")
    print(f"   tokens through the model: full rows {rows * (max_p + max_r)}, "
          f"packed {sum(map(len, prompts)) + sum(lengths)}; packed vs padded logprobs max |diff| {diff:.1e}")
    variants = [
        ("full padded rows (TRL-like)", lambda: (compute_response_logprobs(model, ids, am, pid, max_r) * rmask).sum()),
        ("packed (nexrl default)", lambda: (compute_response_logprobs_packed(
            model, ids, am, pid, max_r, groups) * rmask).sum()),
    ]
    best: dict[str, float] = {}
    for _ in range(args.pack_reps):  # alternate the variants so background load hits all of them
        for name, fn in variants:
            t0 = time.perf_counter()
            fn().backward()
            model.zero_grad(set_to_none=True)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    base = best["full padded rows (TRL-like)"]
    for name, _ in variants:
        print(f"  {name:<30} {best[name]:6.2f} s (best of {args.pack_reps})  {base / best[name]:5.2f}x vs full padded rows")


@contextlib.contextmanager
def _torch_profiler(out: str):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)
    with open(out, "w") as f:
        f.write(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["flow", "step", "pack", "ray", "ray-step", "all"], default="all")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 64], help="flow: rollout workers to try")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256], help="flow: trajectory_pool.batch_size")
    p.add_argument("--group", type=int, default=4, help="flow: GRPO group size")
    p.add_argument("--trajectories", type=int, default=20000,
                   help="flow: trajectories per config (steps = trajectories / batch)")
    p.add_argument("--steps", type=int, default=0, help="flow: trainer steps per config (overrides --trajectories)")
    p.add_argument("--modes", nargs="+", default=["sync"], choices=["sync", "batch-async", "fully-async"])
    p.add_argument("--profile", help="flow: cProfile the first config (all threads) into this file")
    p.add_argument("--flow-rollout-limit", default="null", help="flow: weight.rollout_limit (null or batch)")
    p.add_argument("--real-steps", type=int, default=3, help="step: quickstart steps to run")
    p.add_argument("--rollout-limit", default="batch",
                   help="step: weight.rollout_limit (batch, null, or 'recipe' to keep the recipe's)")
    p.add_argument("--py-spy", help="step: record the run with py-spy into this raw file and summarize it")
    p.add_argument("--max-tokens", type=int, default=48, help="step: rollout_worker.sampling.max_tokens")
    p.add_argument("--save-freq", type=int, default=1, help="step: trainer.save_freq (1: checkpoint every step)")
    p.add_argument("--torch-profile", help="step: write a torch.profiler table to this file")
    p.add_argument("--override", nargs="*", default=[], help="step: extra recipe overrides key=value")
    p.add_argument("--pack-lengths", type=int, nargs="+",
                   default=[7, 48, 12, 30, 48, 26, 9, 17, 41, 14, 48, 22, 6, 33, 19, 48],
                   help="pack: response lengths of the batch (4 groups)")
    p.add_argument("--pack-reps", type=int, default=3, help="pack: timed repetitions per variant")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4], help="ray: actors the workers are spread over")
    p.add_argument("--tasks-per-call", type=int, default=16, help="ray: rollout_worker.tasks_per_call (both modes)")
    p.add_argument("--reps", type=int, default=2, help="ray, ray-step: alternated repetitions")
    p.add_argument("--ray-cpus", type=int, default=None, help="ray, ray-step: CPUs of the local cluster")
    args = p.parse_args(argv)
    if args.part in ("pack", "all"):
        part_pack(args)
    if args.part in ("flow", "all"):
        part_flow(args)
    if args.part in ("step", "all"):
        part_step(args)
    if args.part in ("ray", "all"):
        part_ray(args)
    if args.part in ("ray-step", "all"):
        part_ray_step(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
