"""Data-parallel training: one train service as ``world_size`` ranks over torch.distributed.

Rank 0 lives in the trainer's process and drives; ranks 1..N-1 are processes it spawns, each a
:class:`~nexrl_torch.train.service.LocalTorchTrainService` of its own that serves rank 0's calls.
A call (forward, forward_backward, optim_step, weight export, checkpoints) reaches every rank
through torch.distributed itself: rank 0 broadcasts the method's name and arguments (cloudpickled:
a loss function is a closure) on a gloo group, then every rank runs the method, and the
collectives inside it (FSDP2's all-gathers and reduce-scatters, DDP's all-reduce, the gathering
of results) match across ranks.

Each rank trains on its share of the batch's rows (:func:`shard_rows`: whole prompt groups,
balanced by tokens) and every rank runs the same number of forward and backward passes (a rank
with fewer rows runs empty ones), since each pass is a collective. Gradients are summed across
ranks (the loss of each rank is its share of the whole batch's loss, times the world size that
FSDP and DDP average over), so N ranks reach the weights one process reaches on the same batch,
to float tolerance.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PARALLEL_MODES = ("fsdp", "ddp")
# Long enough for a step's slowest collective; a rank that died is seen sooner (its sockets close).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def shard_rows(prompt_groups: list[int], row_tokens: list[int], world_size: int) -> list[list[int]]:
    """Rows of each rank: whole prompt groups (a group's prompt is computed once per rank that has
    it), largest first to the rank with the fewest tokens so far; each rank's rows in batch order."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(prompt_groups):
        groups.setdefault(group, []).append(row)
    load = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for rows in sorted(groups.values(), key=lambda rows: (-sum(row_tokens[r] for r in rows), rows[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shards[rank].extend(rows)
        load[rank] += sum(row_tokens[r] for r in rows)
    return [sorted(rows) for rows in shards]


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class RankGroup:
    """This process's place among the ranks of one train service."""

    rank: int
    world_size: int
    parallel: str
    objects: Any = None  # the gloo group calls and results travel on
    followers: list[Any] = field(default_factory=list)  # rank 0: ranks 1..N-1 (nexrl_core.launch StartedProcess)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- calls ----------------------------------------------------------------------------------
    def broadcast_call(self, name: str, args: tuple, kwargs: dict) -> None:
        import cloudpickle

        self._guard(lambda: dist.broadcast_object_list([cloudpickle.dumps((name, args, kwargs))], src=0,
                                                       group=self.objects))

    def receive_call(self) -> tuple[str, tuple, dict]:
        import cloudpickle

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return cloudpickle.loads(box[0])

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        self._guard(lambda: dist.all_gather_object(out, value, group=self.objects))
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value]
        self._guard(lambda: dist.broadcast_object_list(box, src=0, group=self.objects))
        return box[0]

    def run(self, call: Any) -> Any:
        """``call()`` on rank 0, with a follower's death turned into one message naming it."""
        return self._guard(call)

    def _guard(self, call: Any) -> Any:
        if not self.leader:
            return call()
        try:
            return call()
        except Exception as exc:
            dead = self.dead_followers()
            if dead:
                from nexrl_core import NexRLError

                raise NexRLError(f"service.train_service: {dead}") from None
            if isinstance(exc, RuntimeError) and "gloo" in str(exc).lower():
                raise RuntimeError(f"service.train_service: a collective failed across ranks ({exc})") from None
            raise

    def dead_followers(self, wait_s: float = 5.0) -> str | None:
        """What ended the followers that are gone ("rank 1 (host, pid 42) stopped: cause")."""
        import time

        deadline = time.monotonic() + wait_s  # a peer's socket closes a moment before its process ends
        while True:
            gone = [(rank, proc) for rank, proc in enumerate(self.followers, start=1) if not proc.is_alive()]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return "; ".join(f"rank {rank} ({proc.host}, pid {proc.pid}) stopped: {proc.exit_cause()}"
                         for rank, proc in gone) or None

    def close(self) -> None:
        """Followers leave their loop (the caller broadcast ``close``), then the group ends."""
        for proc in self.followers:
            proc.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config: dict[str, Any], world_size: int, parallel: str,
                serve: Callable[[dict[str, Any], RankGroup], None]) -> RankGroup:
    """Rank 0 of a new group: start ranks 1..N-1 where the launch mode places processes (each
    runs ``serve(config, its group)``, a module-level function so that it travels by name), then
    meet them at the rendezvous."""
    from nexrl_core import rendezvous_host, start_processes

    if dist.is_initialized():
        raise ValueError("world_size: this process already belongs to a torch.distributed group (one "
                         "distributed train service per process)")
    host = rendezvous_host()
    port = free_port(host)
    group = RankGroup(0, world_size, parallel)
    gpus = 1 if torch.cuda.is_available() else 0
    ranks = range(1, world_size)
    group.followers = start_processes(_follower_main, [(rank, world_size, host, port, config, serve) for rank in ranks],
                                      [f"nexrl-train-rank-{rank}" for rank in ranks], num_gpus=gpus)
    try:
        _join(group, host, port)
    except Exception:
        for proc in group.followers:
            proc.stop(timeout=0)
        raise
    from loguru import logger

    logger.info(f"train service: {world_size} ranks ({parallel}); rank 0 here (pid {os.getpid()}), " + ", ".join(
        f"rank {rank}: {proc.kind} {proc.name} on {proc.host} (pid {proc.pid})"
        for rank, proc in enumerate(group.followers, start=1)))
    return group


def _join(group: RankGroup, host: str, port: int) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=group.rank,
                            world_size=group.world_size, timeout=COLLECTIVE_TIMEOUT)
    group.objects = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" \
        else dist.group.WORLD


def _follower_main(rank: int, world_size: int, host: str, port: int, config: dict[str, Any],
                   serve: Callable[[dict[str, Any], RankGroup], None]) -> None:
    """A follower rank: join the group, then serve rank 0's calls until ``close``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    group = RankGroup(rank, world_size, str(config["parallel"]))
    _join(group, host, port)
    serve(config, group)


def wrap(model: torch.nn.Module, group: RankGroup, device: torch.device) -> torch.nn.Module:
    """What forward passes call: FSDP2 shards ``model`` in place (each decoder layer, then the root:
    parameters, gradients and optimizer state sharded) and it is returned; DDP (replicated) returns
    its wrapper, whose backward all-reduces."""
    if group.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (group.world_size,))
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (an FSDP2 shard is gathered: a collective)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


class GatheredWeights(Mapping):
    """An FSDP2 model's weights by name, each gathered from its shards as iteration reaches it, so a
    consumer that copies them one by one (the engine's ``load_weights``) never holds a second whole
    model. ``shapes`` tells each weight's shape without gathering. Iterate it once, to the end, on
    every rank (each gather is a collective, in state-dict order); pickled (sent to another
    process) it gathers everything first."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state
        self.shapes = {name: tuple(value.shape) for name, value in state.items()}
        self._consumed = False

    def __len__(self) -> int:
        return len(self._state)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __getitem__(self, name: str) -> torch.Tensor:
        raise TypeError("GatheredWeights: iterate items() in order (each weight is gathered once, on every rank)")

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        if self._consumed:
            raise RuntimeError("GatheredWeights: already iterated (each weight is gathered once)")
        self._consumed = True
        for name, value in self._state.items():
            yield name, full_tensor(value.detach())

    def drain(self) -> None:
        """A follower's side of a consumer's iteration: the same gathers, results dropped."""
        for _ in self.items():
            pass

    def __reduce__(self) -> tuple:
        return dict, (list(self.items()),)
