"""Core data types shared by every component (the seed's ``nexrl_types``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

ModelTag = str
Trajectory = dict[str, Any]

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
        return [{k: v[i] for k, v in self.values.items()} for i in range(len(self))]

    @staticmethod
    def remove_redundant_left_padding(data: Batch, pad_token_id: int, fields: list[str],
                                      anchor_field: str, max_strip_threshold: int | None = None) -> Batch:
        """Drop leading columns that are padding in every row of ``anchor_field``."""
        anchor = data.values[anchor_field]
        is_pad = anchor == pad_token_id
        n = _leading_all_true(is_pad.all(dim=0).tolist())
        if max_strip_threshold is not None:
            n = min(n, max_strip_threshold)
        if n:
            for name in fields:
                data.values[name] = data.values[name][:, n:]
        return data

    @staticmethod
    def remove_redundant_right_padding(data: Batch, pad_token_id: int, fields: list[str],
                                       anchor_field: str, max_strip_threshold: int | None = None) -> Batch:
        """Drop trailing columns that are padding in every row of ``anchor_field``."""
        anchor = data.values[anchor_field]
        is_pad = anchor == pad_token_id
        n = _leading_all_true(is_pad.all(dim=0).tolist()[::-1])
        if max_strip_threshold is not None:
            n = min(n, max_strip_threshold)
        if n:
            width = anchor.shape[1]
            for name in fields:
                data.values[name] = data.values[name][:, : width - n]
        return data


def _leading_all_true(flags: list[bool]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def trajectory_reward(trajectory: Trajectory) -> float:
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


def trajectory_segments(trajectory: Trajectory) -> list[dict[str, Any]]:
    """The token sequences a trajectory trains on, each with ``prompt_token_ids``,
    ``response_token_ids``, ``response_logprobs`` (or None) and ``loss_mask`` (one 0/1 per response
    token; None when the trajectory has none: every response token is trained).

    A single-turn trajectory is one sequence (its top-level keys). A multi-turn agent rollout whose
    turns could not all be laid into one sequence carries them all in ``segments`` (the top level
    then repeats the first). Every trainer reads trajectories through this function, so a
    ``loss_mask`` is never ignored. Raises ValueError when a mask does not fit its response.
    """
    raw = trajectory.get("segments") or [trajectory]
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
