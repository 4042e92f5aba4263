"""``nexrl plan``: what a run will hold in memory, per device, before it starts.

A component that can say so answers ``memory_plan(section, inputs) -> MemoryPlan`` (a classmethod
of its train service or inference backend class): the items it holds on each device (weights,
gradients, optimizer state, activations, KV cache, ...) with their bytes, and what a recipe could
change to hold less. The core adds them up per device and compares with what the device has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


@dataclass(frozen=True)
class MemoryItem:
    """One thing a component holds: ``bytes`` on ``device`` (``cpu``, ``cuda:0``...)."""

    device: str
    role: str  # who holds it: "train service", "inference engine"
    what: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Saving:
    """A change to the recipe and the bytes it would free on ``device``."""

    device: str
    change: str
    bytes: int


@dataclass
class MemoryPlan:
    items: list[MemoryItem] = field(default_factory=list)
    savings: list[Saving] = field(default_factory=list)
    #: what each device has (bytes), where the component can tell
    capacity: dict[str, int] = field(default_factory=dict)
    #: modules of the planned components (what the run's process imports; ``nexrl plan`` measures them)
    modules: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlanInputs:
    """What the recipe says about the work, for the components' plans."""

    prompts: list[Any]  # prompts of the training data as the rollout worker sends them (text or messages)
    max_new_tokens: int  # the most tokens a response may have
    batch_size: int  # samples per training step
    group_size: int  # samples per prompt
    concurrent_requests: int  # requests the inference service may decode at once (workers x tasks per call)
    frozen_reference: bool = False  # the trainer holds a frozen copy of the model as its KL reference


def parse_size(text: str) -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1e9`` -> bytes; ValueError naming the text otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"'{text}' is not a memory size (e.g. 24GiB, 80GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny model's parts still read as numbers)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def report(plan: MemoryPlan, capacity: dict[str, int]) -> tuple[list[str], bool]:
    """The printed plan and whether every device's total fits what it has (True where unknown)."""
    lines: list[str] = []
    fits = True
    devices = list(dict.fromkeys(item.device for item in plan.items))
    for device in devices:
        items = [item for item in plan.items if item.device == device]
        total = sum(item.bytes for item in items)
        lines.append(f"{device}:")
        width = max(len(f"{i.role}: {i.what}") for i in items)
        for item in items:
            label = f"{item.role}: {item.what}"
            lines.append(f"  {label:<{width}}  {gib(item.bytes):>11}" + (f"  ({item.note})" if item.note else ""))
        has = capacity.get(device)
        if has is None:
            lines.append(f"  {'total':<{width}}  {gib(total):>11}  (what the device has is unknown: --device-memory)")
            continue
        if total <= has:
            lines.append(f"  {'total':<{width}}  {gib(total):>11}  fits in {gib(has)} ({gib(has - total)} left)")
            continue
        fits = False
        short = total - has
        lines.append(f"  {'total':<{width}}  {gib(total):>11}  does NOT fit in {gib(has)}: {gib(short)} over")
        savings = sorted((s for s in plan.savings if s.device == device), key=lambda s: -s.bytes)
        for saving in savings:
            enough = " (enough alone)" if saving.bytes >= short else ""
            lines.append(f"    to save {gib(saving.bytes)}: {saving.change}{enough}")
    return lines, fits
