"""``nexrl plan RECIPE [overrides] [--device-memory SIZE]``: the run's memory per device before
it starts (weights, gradients, optimizer state, activations, the engine's KV cache...), whether it
fits, and what to change when it does not. Exit 0: it fits (or what a device has is unknown);
1: it does not; 2: the recipe has problems."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: prompts of the training data read for their length (the longest decides)
PROMPTS_READ = 512
DEFAULT_PROMPT_KEY = "prompt"  # where a worker without prompt_key finds the prompt (the data loaders' column)


def plan_inputs(cfg: DictConfig, pm: Any) -> Any:
    """What the recipe says about the work (:class:`PlanInputs`), the data's prompts included."""
    from omegaconf import OmegaConf

    from ..launch.preflight import build_dataloader
    from ..runtime.inference import SamplingParams
    from ..runtime.memory_plan import PlanInputs

    worker = cfg.rollout_worker
    # The simple worker's keys, where the recipe's worker declares them (load_recipe filled them in).
    max_tokens = OmegaConf.select(cfg, "rollout_worker.sampling.max_tokens")
    if max_tokens is None:  # a worker with sampling of its own making
        max_tokens = SamplingParams().max_tokens
    loader = build_dataloader(cfg, pm, "data")
    prompt_key = str(OmegaConf.select(cfg, "rollout_worker.prompt_key") or DEFAULT_PROMPT_KEY)
    system = OmegaConf.select(cfg, "rollout_worker.system_prompt")
    chat = OmegaConf.select(cfg, "rollout_worker.use_chat") is not False
    prompts: list[Any] = []
    for row in loader.rows()[:PROMPTS_READ]:
        prompt = row.get(prompt_key)
        if isinstance(prompt, str) and chat:  # as the simple worker sends it
            prompt = ([{"role": "system", "content": str(system)}] if system else []) + \
                [{"role": "user", "content": prompt}]
        if prompt:
            prompts.append(prompt)
    algorithm = cfg.algorithm
    uses_kl = bool(algorithm.get("use_kl_loss") or algorithm.get("use_kl_in_reward"))
    return PlanInputs(prompts=prompts, max_new_tokens=int(max_tokens), batch_size=int(cfg.trajectory_pool.batch_size),
                      group_size=int(cfg.trajectory_pool.group_size),
                      concurrent_requests=int(worker.num_workers) * int(worker.tasks_per_call),
                      frozen_reference=uses_kl and cfg.service.reference_service is None)


def component_plans(cfg: DictConfig, pm: Any, inputs: Any) -> tuple[Any, list[str]]:
    """The train service's and the inference backend's plans, merged; and a line for each part
    that gives none."""
    from ..runtime.memory_plan import MemoryPlan
    from ..runtime.train_service import train_service_class

    plan, silent = MemoryPlan(), []
    trainer_cls = pm.resolve("trainer", cfg.trainer.type, "trainer.type")
    parts: list[tuple[str, Any, Any]] = []
    if getattr(trainer_cls, "TRAIN_SERVICE_DEFAULT", None) or cfg.service.train_service.get("backend"):
        service_cls = train_service_class(trainer_cls, cfg.service.train_service, pm, str(cfg.trainer.type))
        parts.append((f"train service {getattr(service_cls, '__name__', '?')}", service_cls,
                      cfg.service.train_service))
    inference = cfg.service.inference_service
    parts.append((f"inference backend '{inference.backend}'",
                  pm.resolve("inference_backend", inference.backend, "service.inference_service.backend"), inference))
    for label, cls, section in parts:
        planner = getattr(cls, "memory_plan", None)
        part = planner(section, inputs) if planner is not None else None
        if part is None:
            silent.append(f"{label} gives no memory plan (its memory is not counted)")
            continue
        plan.items += part.items
        plan.modules.append(cls.__module__)
        plan.savings += part.savings
        plan.capacity.update(part.capacity)
    return plan, silent


def as_json(plan: Any, capacity: dict[str, int]) -> dict[str, Any]:
    """The plan as data: per device its items, total, capacity and whether it fits (None: unknown)."""
    devices: dict[str, Any] = {}
    for item in plan.items:
        entry = devices.setdefault(item.device, {"items": [], "total": 0})
        entry["items"].append({"role": item.role, "what": item.what, "bytes": item.bytes, "note": item.note})
        entry["total"] += item.bytes
    for device, entry in devices.items():
        entry["capacity"] = capacity.get(device)
        entry["fits"] = None if entry["capacity"] is None else entry["total"] <= entry["capacity"]
    savings = [{"device": s.device, "change": s.change, "bytes": s.bytes} for s in plan.savings]
    return {"devices": devices, "savings": savings}


def runtime_bytes(modules: list[str]) -> int:
    """The peak resident size of a fresh Python process that imports ``modules`` (and nexrl_core):
    what a run's process holds before its model (not this process's, which may hold anything)."""
    return _runtime_bytes(tuple(sorted(set(modules))))


@functools.cache
def _runtime_bytes(modules: tuple[str, ...]) -> int:
    code = ("import importlib, resource, sys\n"
            "for name in sys.argv[1:]: importlib.import_module(name)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code, "nexrl_core", *modules], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the runtime's memory failed: {out.stderr.strip()[-500:]}")
    return int(out.stdout.strip().splitlines()[-1])


def plan_command(args: Any) -> int:
    from ..launch.recipe import load_recipe, require_valid
    from ..plugins import get_plugin_manager
    from ..runtime.memory_plan import MemoryItem, parse_size, report

    cfg = load_recipe(args.recipe, list(args.overrides))
    pm = get_plugin_manager()
    require_valid(cfg, pm)
    inputs = plan_inputs(cfg, pm)
    plan, silent = component_plans(cfg, pm, inputs)
    capacity = dict(plan.capacity)
    if args.device_memory:
        try:
            size = parse_size(args.device_memory)
        except ValueError as exc:
            print(f"error: --device-memory: {exc}", file=sys.stderr)
            return 2
        capacity = {item.device: size for item in plan.items}
    if plan.items:  # one Python process holds them (launch_mode local; Ray: one per actor)
        plan.items.append(MemoryItem("cpu", "process", "python and the libraries a run imports",
                                     runtime_bytes(plan.modules), "measured in a fresh process"))
    if args.json:
        print(json.dumps(as_json(plan, capacity)))
        return 0 if all(d["fits"] is not False for d in as_json(plan, capacity)["devices"].values()) else 1
    print(f"nexrl plan · {args.recipe}: {inputs.batch_size} samples a step ({inputs.group_size} per prompt), "
          f"responses of at most {inputs.max_new_tokens} tokens, {inputs.concurrent_requests} requests decoded "
          f"at once at most")
    lines, fits = report(plan, capacity)
    print("\n".join(lines))
    for line in silent:
        print(f"note: {line}", file=sys.stderr)
    return 0 if fits else 1
