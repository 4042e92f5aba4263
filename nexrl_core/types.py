"""Core data types shared by every component (the seed's ``nexrl_types``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict, cast

ModelTag = str


class Trajectory(TypedDict, total=False):
    """One sample of a rollout, as it travels worker -> pool -> trainer (a plain dict at run time).

    Every key is optional to the type; a worker may add keys of its own (an agent's
    ``num_tool_calls``: docs/agents.md), which the pool and the trainers carry along untouched.
    """

    # identity: copied from the task (BaseRolloutWorker.base_trajectory)
    uid: Any                   # groups the samples of one task (trajectory_pool.key_list)
    sample_index: int | None   # which of the task's group_size samples
    seq: int | None            # the task's row number in its data loader (order, resume)
    data_source: str           # names validation metrics (val/<data_source>_<score_key>)
    domain: str | None         # picks the evaluator and the reward processing (multi-domain data)
    model_tag: str             # the model the sample trains
    rollout_worker: str        # the worker that made it (named when a trainer refuses it)
    is_validation: bool
    task: dict[str, Any]       # the data row itself (re-queued when the sample is re-rolled)
    # the rollout
    prompt: Any                # text or chat messages
    response: str
    finish_reason: str | None  # "stop" | "length" | ...
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None
    loss_mask: list[int] | None  # one 0/1 per response token (None: train every token)
    segments: list[dict[str, Any]]  # a multi-turn rollout's sequences (trajectory_segments)
    sampling: dict[str, Any]   # the SamplingParams that produced the tokens (SamplingParams.as_record)
    model_version: int         # the weights it was sampled with (staleness)
    # the evaluation
    reward: float              # required of every usable trajectory (trajectory_reward)
    ground_truth: str
    score: dict[str, float]    # reward and the evaluator's metrics
    extra_info: dict[str, Any]
    # a failed sample (kept so its group completes; reward 0)
    failed: bool
    error: str
    error_cause: str           # errors.jsonl's cause
    error_traceback: str
    # set by the trainer
    advantage: float


DEFAULT_MODEL_TAG: ModelTag = "default"


class NexRLRole(Enum):
    ROLLOUT_WORKER = "rollout_worker"
    TRAINER = "trainer"
    TRAJECTORY_POOL = "trajectory_pool"
    WEIGHT_SYNC_CONTROLLER = "weight_sync_controller"
    DATA_LOADER = "data_loader"
    VALIDATE_DATALOADER = "validate_dataloader"
    VALIDATOR = "validator"
    # Not modules of the seed's data path, but placed by the launch mode like them.
    ACTIVITY_TRACKER = "activity_tracker"
    INFERENCE_SERVICE = "inference_service"


@dataclass
class Batch:
    """Column-oriented trajectories: every value has ``metadata['batch_size']`` rows."""

    values: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.metadata.get("batch_size", 0))

    def copy(self) -> Batch:
        return Batch(copy.deepcopy(self.values), copy.deepcopy(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        return {**self.values, **self.metadata}

    @staticmethod
    def from_trajectories(trajectories: list[Trajectory], model_tag: ModelTag = DEFAULT_MODEL_TAG) -> Batch:
        keys: list[str] = []
        for traj in trajectories:
            keys.extend(k for k in traj if k not in keys)
        values = {k: [t.get(k) for t in trajectories] for k in keys}
        return Batch(values, {"batch_size": len(trajectories), "model_tag": model_tag})

    def to_trajectories(self) -> list[Trajectory]:
        return [cast(Trajectory, {k: v[i] for k, v in self.values.items()}) for i in range(len(self))]


def trajectory_reward(trajectory: Mapping[str, Any]) -> float:
    """The trajectory's ``reward``: 0.0 for a failed one, and a ValueError naming the trajectory
    when a usable one has none (never a silent 0: rollout workers must set it)."""
    reward = trajectory.get("reward")
    if reward is None and trajectory.get("failed"):
        return 0.0
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index')} has "
                         f"{'no reward' if reward is None else f'reward {reward!r}'}: a rollout worker must set a "
                         f"number 'reward' on every trajectory it hands on")
    return float(reward)


SEGMENT_KEYS = ("prompt_token_ids", "response_token_ids", "response_logprobs", "loss_mask")


def trajectory_segments(trajectory: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The token sequences a trajectory trains on, each with ``prompt_token_ids``,
    ``response_token_ids``, ``response_logprobs`` (or None) and ``loss_mask`` (one 0/1 per response
    token; None when the trajectory has none: every response token is trained).

    A single-turn trajectory is one sequence (its top-level keys). A multi-turn agent rollout whose
    turns could not all be laid into one sequence carries them all in ``segments`` (the top level
    then repeats the first). Every trainer reads trajectories through this function, so a
    ``loss_mask`` is never ignored. Raises ValueError when a mask does not fit its response.
    """
    raw: list[Any] = trajectory.get("segments") or [trajectory]
    out = []
    for i, seg in enumerate(raw):
        response = seg.get("response_token_ids")
        mask = seg.get("loss_mask")
        if mask is not None and response is not None and len(mask) != len(response):
            where = f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index')}"
            raise ValueError(f"{where}{f' segment {i}' if 'segments' in trajectory else ''}: loss_mask has "
                             f"{len(mask)} entries for {len(response)} response tokens")
        out.append({"prompt_token_ids": seg.get("prompt_token_ids"), "response_token_ids": response,
                    "response_logprobs": seg.get("response_logprobs"),
                    "loss_mask": None if mask is None else [1 if m else 0 for m in mask]})
    return out
