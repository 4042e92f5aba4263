"""Core data types shared by every component (the seed's ``nexrl_types``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, TypedDict

ModelTag = str


def lookup(root: Any, dotted: str, default: Any = None) -> Any:
    """The value the dotted key names in nested mappings (``a.b``: ``root["a"]["b"]``), else ``default``."""
    node = root
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


class Trajectory(TypedDict, total=False):
    """One sample of a rollout, as it travels worker -> pool -> trainer (a plain dict at run time).

    Every key is optional to the type; a worker may add keys of its own (an agent's
    ``num_tool_calls``: docs/agents.md), which the pool and the trainers carry along untouched.
    Nothing downstream writes into it: what a trainer computes per sample is a :class:`SampleResult`.
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
    token_versions: list[int]  # the weights each response token was sampled with (trajectory_token_versions)
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


@dataclass(frozen=True)
class TrajectoryBatch:
    """What the pool hands the trainer: whole groups of trajectories, as the workers made them
    (rows, never copied into columns), ordered by issue (groups by version and first ``seq``,
    members by ``seq``). The trainer reads them and writes nothing into them."""

    trajectories: tuple[Trajectory, ...]
    model_tag: ModelTag = DEFAULT_MODEL_TAG
    num_groups: int = 0
    #: dynamic sampling: ``{"domain", "rewards"}`` of each group dropped since the previous batch;
    #: None when it is off (``trajectory_pool.dynamic_sampling``)
    dropped_groups: tuple[dict[str, Any], ...] | None = None

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class SampleResult:
    """What a training step computed for one of its samples: samples.jsonl and ``nexrl show``
    report it beside the trajectory's own keys."""

    #: the mean advantage over the sample's trained tokens
    advantage: float | None = None
    #: its largest |trainer - rollout log-prob| over its trained tokens
    #: (:func:`nexrl_core.algorithms.sample_logprob_gaps`): ``max``, ``position``, ``token``, ``segment``
    logprob_gap: Mapping[str, float | int | str] | None = None

    def as_record(self) -> dict[str, Any]:
        """The fields that were computed, as samples.jsonl keys."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class TrainOutput:
    """What :meth:`nexrl_core.BaseTrainer.train` returns when it has per-sample results (a trainer
    without any returns its metrics alone)."""

    metrics: dict[str, float]
    #: by the index of the sample in the list ``train`` was given; a sample may have none
    samples: Mapping[int, SampleResult] = field(default_factory=dict)


@dataclass
class Batch:
    """The padded tensors a self-hosted trainer trains on (``values``: ``input_ids``,
    ``response_mask``, ``advantages``, ..., one row per token sequence) and what they came from
    (``metadata``: ``row_trajectory``, ``uids``, ``batch_size`` rows, ...): what
    ``_prepare_batch`` and ``_loss_fn`` receive (nexrl_grpo.trainers.SelfHostedTrainer)."""

    values: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.metadata.get("batch_size", 0))

    def copy(self) -> Batch:
        return Batch(copy.deepcopy(self.values), copy.deepcopy(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        return {**self.values, **self.metadata}


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



def _segment_versions(trajectory: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """Each sequence's ``(versions, loss_mask)``: its own ``token_versions`` where it has one per
    response token, else its trajectory's ``model_version`` for each; the mask when it fits."""
    fallback = trajectory.get("model_version")
    out = []
    for seg in trajectory.get("segments") or [trajectory]:
        response = seg.get("response_token_ids")
        if not isinstance(response, (list, tuple)):
            continue
        versions = seg.get("token_versions")
        if not isinstance(versions, (list, tuple)) or len(versions) != len(response):
            if not isinstance(fallback, int) or isinstance(fallback, bool):
                continue
            versions = [fallback] * len(response)
        mask = seg.get("loss_mask")
        out.append((versions, mask if isinstance(mask, (list, tuple)) and len(mask) == len(response) else None))
    return out


def trajectory_token_versions(trajectory: Mapping[str, Any]) -> list[int]:
    """The weight version that sampled each *trained* response token of ``trajectory``, over its
    sequences (:func:`trajectory_segments`' order): a sequence's own ``token_versions`` where it
    has one per response token, else its trajectory's ``model_version`` for each token. Tokens a
    ``loss_mask`` leaves out (tool output, template glue) were not sampled and are skipped. Empty
    when the trajectory has no response token ids (or no version at all)."""
    out: list[int] = []
    for versions, mask in _segment_versions(trajectory):
        out.extend(versions if mask is None else (v for v, m in zip(versions, mask) if m))
    return [int(v) for v in out]


def oldest_version(trajectory: Mapping[str, Any]) -> int:
    """The oldest weight version among ``trajectory``'s trained tokens
    (:func:`trajectory_token_versions`); its ``model_version`` (0 without one) when it has none:
    what the pool bounds its staleness by."""
    oldest = None
    for versions, mask in _segment_versions(trajectory):
        kept = versions if mask is None else [v for v, m in zip(versions, mask) if m]
        if kept:
            low = int(min(kept))
            oldest = low if oldest is None else min(oldest, low)
    return int(trajectory.get("model_version", 0) or 0) if oldest is None else oldest
