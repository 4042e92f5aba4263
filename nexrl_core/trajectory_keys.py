"""The keys a trajectory carries for each kind of trainer, with their types: one table, read by
the trainers' check where they take a batch from the pool (:meth:`BaseTrainer.check_trajectory`),
and written out in docs/extending.md. A trainer names its contract with ``TRAJECTORY_CONTRACT``.

Types are Python types or tuples of them, as ``isinstance`` takes them; a key whose value may be
absent or None is ``required=False`` (the check then only looks at its type when it is set).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrajectoryKey:
    name: str
    types: tuple[type, ...]
    type_text: str  # how docs and messages write the type
    help: str
    required: bool = True


_NUMBER = (int, float)

#: every trainer: how the trajectory is grouped, scored and dated (a worker's base class fills
#: ``uid``, ``sample_index``, ``model_version`` and ``token_versions`` in from the task it is running)
COMMON = (
    TrajectoryKey("uid", (str, int), "str | int", "the task's id: trajectories of one task form a group"),
    TrajectoryKey("reward", _NUMBER, "float", "the evaluator's score (finite)"),
    TrajectoryKey("model_version", (int,), "int", "the weight version that sampled it (staleness)", False),
    TrajectoryKey("token_versions", (list, tuple), "list[int]",
                  "the weight version that sampled each response token (per-token staleness; the base "
                  "worker fills it in, model_version for every token unless the backend reports its own)", False),
    TrajectoryKey("sample_index", (int,), "int", "which of the group's samples it is", False),
    TrajectoryKey("data_source", (str,), "str", "metrics per source (val/<data_source>_<score>)", False),
    TrajectoryKey("score", (Mapping,), "dict[str, float]", "the evaluator's metrics (rollout/<name>)", False),
)

_TOKENS = (
    TrajectoryKey("prompt_token_ids", (list, tuple), "list[int]", "the prompt as the inference service encoded it"),
    TrajectoryKey("response_token_ids", (list, tuple), "list[int]", "the sampled tokens"),
)
_SAMPLING = TrajectoryKey("sampling", (Mapping,), "dict (SamplingParams.as_record())",
                          "how it was sampled: log-probs are taken at its temperature")
_LOGPROBS = TrajectoryKey("response_logprobs", (list, tuple), "list[float]",
                          "the sampler's log-prob of each response token", False)

CONTRACTS: dict[str, tuple[TrajectoryKey, ...]] = {
    # RL on the trainer's own model (nexrl-grpo self_hosted_grpo)
    "self_hosted": COMMON + _TOKENS + (_SAMPLING, _LOGPROBS),
    # RL through a remote API (nexrl-tinker remote_api_grpo): the service scores against the sampler's log-probs
    "remote_api": COMMON + _TOKENS + (_SAMPLING, TrajectoryKey(
        "response_logprobs", (list, tuple), "list[float]", "the sampler's log-prob of each response token")),
    # supervised fine-tuning (self_hosted_cross_entropy, remote_api_cross_entropy): the text is the data;
    # token ids, when set, are used instead
    "sft": (
        TrajectoryKey("uid", (str, int), "str | int", "the task's id"),
        TrajectoryKey("prompt", (str, list), "str | list[dict] (chat messages)", "the input"),
        TrajectoryKey("response", (str,), "str", "the target text"),
    ) + tuple(TrajectoryKey(k.name, k.types, k.type_text, k.help, False) for k in _TOKENS),
    # an agent's trajectory (nexrl-nexau), read by the RL trainers above on top of their own keys
    "agent": COMMON + _TOKENS + (_SAMPLING, _LOGPROBS,
                                 TrajectoryKey("loss_mask", (list, tuple), "list[int]",
                                               "one 0/1 per response token: 0 for tool output and glue", False),
                                 TrajectoryKey("segments", (list,), "list[dict]",
                                               "the token sequences of a rollout whose turns did not merge into "
                                               "one, each with the four token keys", False)),
}


def trajectory_problem(trajectory: Mapping[str, Any], contract: str) -> str | None:
    """The first key of ``contract`` that ``trajectory`` lacks or has of the wrong type, said in
    one phrase (None: it keeps the contract)."""
    for key in CONTRACTS[contract]:
        value = trajectory.get(key.name)
        if value is None:
            if key.required and not (contract == "sft" and key.name in ("prompt", "response")
                                     and trajectory.get(f"{key.name}_token_ids") is not None):
                return f"has no '{key.name}' ({key.type_text}: {key.help})"
            continue
        if isinstance(value, bool) and bool not in key.types or not isinstance(value, key.types):
            return f"has '{key.name}' of type {type(value).__name__}, expected {key.type_text}"
    return None
