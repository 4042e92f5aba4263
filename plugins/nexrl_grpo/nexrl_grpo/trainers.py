"""Self-hosted trainers: trajectories -> padded tensors -> algorithm -> local torch train service."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from loguru import logger

from nexrl_core import (
    BaseTrainer,
    Batch,
    Capabilities,
    ConfigError,
    DataError,
    InferenceError,
    NexRLError,
    Option,
    SampleResult,
    SamplingParams,
    Settings,
    TrainerParts,
    TrainOutput,
    Trajectory,
    algorithms,
    setting,
    trajectory_reward,
    trajectory_segments,
)
from nexrl_torch.logprobs import compute_response_logprobs, position_ids_from_mask
from nexrl_torch.models import DEVICE_HELP, device_problem, resolve_device
from nexrl_torch.train.service import BATCH_FORMAT, ROW_OUTPUTS, LocalTorchTrainService, export_model_folder

from .critic import CRITIC_ALGORITHM_OPTIONS, CriticAlgorithmSettings, CriticService, ValueModel
from .losses import LossContext, agg_loss, behaviour_weights, kl_loss, masked_mean, value_loss

CRITIC_FOLDER = "critic"  # inside a checkpoint folder, next to the policy's files
KL_AGG_MODE_WITHOUT_LOSS_MODE = "token-mean"  # the KL term's reduction when the policy loss declares no mode
Objective = Literal["standard", "decoupled"]  # algorithm.objective
OBJECTIVES: tuple[str, ...] = get_args(Objective)
# What a self-hosted trainer hands its train service: micro-batch log-probs -> (loss, metrics).
LossFn = Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]


def _sample_advantages(advantages: torch.Tensor, mask: torch.Tensor, row_trajectory: list[int]) -> dict[int, float]:
    """Each sample's mean advantage over its trained tokens, by its index (what samples.jsonl and
    ``nexrl show`` report; one number per sample, as GRPO's is constant over the tokens)."""
    sums: dict[int, float] = {}
    counts: dict[int, float] = {}
    per_row = (advantages * mask).sum(-1).tolist()
    tokens = mask.sum(-1).tolist()
    for row, i in enumerate(row_trajectory):
        sums[i] = sums.get(i, 0.0) + per_row[row]
        counts[i] = counts.get(i, 0.0) + tokens[row]
    return {i: sums[i] / count for i, count in counts.items() if count}


def _sample_logprob_gaps(rows: Mapping[str, list[float]], responses: torch.Tensor, row_trajectory: list[int],
                         tokenizer: Any) -> dict[int, dict[str, Any]]:
    """Each sample's own largest |trainer - rollout log-prob| over its trained tokens
    (:func:`nexrl_core.algorithms.sample_logprob_gaps`) with the ``token`` text where it is, from
    the loss's per-row values, by the sample's index."""
    if "logprob_gap" not in rows or "logprob_gap_position" not in rows:
        return {}
    found = algorithms.sample_logprob_gaps(np.asarray(rows["logprob_gap"]), np.asarray(rows["logprob_gap_position"]),
                                           row_trajectory)
    out = {}
    for i, (row, record) in found.items():
        if tokenizer is not None:
            record["token"] = tokenizer.decode([int(responses[row, record["position"]])])
        out[i] = record
    return out


def _per_token(advantages: Any, mask: torch.Tensor) -> torch.Tensor:
    """Advantages as ``[rows, response tokens]``: one number per row (a list or a 1-D tensor, as a
    ``_prepare_batch`` written for the seed may give) is spread over the row's tokens."""
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if adv.dim() == 1 and adv.shape[0] == mask.shape[0]:
        return adv[:, None].expand_as(mask).contiguous()
    if adv.shape != mask.shape:
        raise ConfigError(f"batch.values['advantages'] has shape {list(adv.shape)}; expected [{mask.shape[0]}] (one "
                          f"per row) or {list(mask.shape)} (one per response token)")
    return adv


def _prompt_groups(prompts: list[list[int]]) -> torch.Tensor:
    """Rows with identical prompt tokens get one id, so the model runs each distinct prompt once."""
    ids: dict[tuple[int, ...], int] = {}
    return torch.tensor([ids.setdefault(tuple(p), len(ids)) for p in prompts], dtype=torch.long)


def served_log_probs(client: Any, batch: Batch, section: str = "service.reference_service") -> torch.Tensor:
    """``client.score`` (:meth:`nexrl_core.InferenceClient.score`) of each row's real tokens (its
    padding dropped), at the row's temperature, in the batch's ``[rows, response_length]`` layout:
    a KL reference's or a teacher's log-probs of the tokens the policy sampled."""
    v, max_p = batch.values, batch.values["prompts"].shape[1]
    real = v["attention_mask"].bool()
    requests = [(v["input_ids"][i, :max_p][real[i, :max_p]].tolist(),
                 v["input_ids"][i, max_p:][real[i, max_p:]].tolist(), float(v["temperature"][i]))
                for i in range(v["input_ids"].shape[0])]
    scored = client.score(requests)
    out = torch.zeros(v["responses"].shape, dtype=torch.float32)
    for i, ((_, response, _), lp) in enumerate(zip(requests, scored)):
        if len(lp) != len(response):
            raise InferenceError(f"{section} scored {len(lp)} tokens of a {len(response)}-token response")
        out[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


class TrajectoryView:
    """Rows (token sequences) <-> trajectories. A trajectory's rows are laid end to end, padding
    included (``[T, k * R]`` for at most ``k`` rows of width ``R`` per trajectory), so per-token
    arrays can be handed to the algorithm one trajectory per row and split back afterwards. With
    one row per trajectory (every single-turn batch) both directions are the identity."""

    def __init__(self, row_trajectory: list[int], width: int):
        self.index = np.asarray(row_trajectory, dtype=np.int64)
        self.width = width
        self.count = int(self.index.max()) + 1 if len(self.index) else 0
        self.slot = np.zeros(len(self.index), dtype=np.int64)  # position of a row within its trajectory
        seen: dict[int, int] = {}
        for row, traj in enumerate(row_trajectory):
            self.slot[row] = seen.get(traj, 0)
            seen[traj] = self.slot[row] + 1
        self.slots = int(self.slot.max()) + 1 if len(self.slot) else 1
        self.identity = self.slots == 1 and np.array_equal(self.index, np.arange(len(self.index)))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        if self.identity:
            return rows
        out = np.zeros((self.count, self.slots * self.width), dtype=rows.dtype)
        for row, (traj, slot) in enumerate(zip(self.index, self.slot)):
            out[traj, slot * self.width:(slot + 1) * self.width] = rows[row]
        return out

    def scatter(self, trajectories: np.ndarray) -> np.ndarray:
        if self.identity:
            return trajectories
        return np.stack([trajectories[traj, slot * self.width:(slot + 1) * self.width]
                         for traj, slot in zip(self.index, self.slot)])

    def first(self, per_row: Any) -> Any:
        """A per-row value that is the same on every row of a trajectory, once per trajectory."""
        if self.identity:
            return per_row
        picked = [per_row[int(np.nonzero(self.index == t)[0][0])] for t in range(self.count)]
        return np.asarray(picked) if isinstance(per_row, np.ndarray) else picked


class SelfHostedTrainer(BaseTrainer):
    """Turns trajectories into verl-layout tensors; subclasses add the algorithm in ``_prepare_batch``."""

    # Padded tensors and a torch loss: any train service taking those (local_torch by default).
    TRAIN_SERVICE_BATCH_FORMAT = BATCH_FORMAT
    TRAIN_SERVICE_DEFAULT = "local_torch"
    TRAJECTORY_CONTRACT = "self_hosted"
    ALGORITHM_OPTIONS: dict[str, Option] = {}
    # New weights exist as tensors in this process: a weight-sync backend must bring them to inference.
    CAPABILITIES = Capabilities(
        provides={"trainer:state_dict"},
        requires={"weight_sync:state_dict": "it trains new weights in this process, and without a backend that "
                                            "moves them, rollouts keep sampling the initial model"})

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        self.train_service: LocalTorchTrainService | None = None
        self.pad_token_id = 0
        self._ppo_epochs = 1

    def initialize_workers(self) -> None:
        if self.train_service is not None:
            return
        t0 = time.perf_counter()
        service = self.create_train_service()
        if not isinstance(service, LocalTorchTrainService):
            raise ConfigError(f"service.train_service.backend: {type(self).__name__} trains through nexrl-torch's "
                              f"LocalTorchTrainService (its tokenizer, checkpoints and frozen copies), not "
                              f"{type(service).__name__}")
        self.train_service = service
        tok = service.tokenizer
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        logger.info(f"train service ready ({service.config.get('model_path')}, {time.perf_counter() - t0:.1f}s)")

    @property
    def service(self) -> LocalTorchTrainService:
        """The train service :meth:`initialize_workers` built."""
        if self.train_service is None:
            raise NexRLError(f"{type(self).__name__} has no train service yet: call initialize_workers first")
        return self.train_service

    # -- trajectories -> tensors -------------------------------------------------------
    def _token_ids(self, traj: Trajectory) -> tuple[list[int], list[int]]:
        prompt_ids, response_ids = traj.get("prompt_token_ids"), traj.get("response_token_ids")
        if prompt_ids is None or response_ids is None:
            raise ConfigError(
                f"trajectory {traj.get('uid')}#{traj.get('sample_index')} has no token ids: self-hosted training "
                f"needs the inference backend to return prompt and response token ids (vLLM: return_token_ids)")
        return list(prompt_ids), list(response_ids)

    def _segments(self, traj: Trajectory) -> list[dict[str, Any]]:
        """The token sequences ``traj`` trains on (:func:`nexrl_core.trajectory_segments`): one for a
        single-turn sample, several for an agent rollout whose turns did not merge into one, each
        with its per-token ``loss_mask`` (None: every response token is trained)."""
        try:
            segments = trajectory_segments(traj)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        for seg in segments:  # a single sequence is the trajectory's own keys (SFT may tokenize its text)
            source: Trajectory = traj
            if traj.get("segments"):
                source = {"uid": traj.get("uid"), "sample_index": traj.get("sample_index"),
                          "prompt_token_ids": seg["prompt_token_ids"], "response_token_ids": seg["response_token_ids"],
                          "response_logprobs": seg["response_logprobs"], "loss_mask": seg["loss_mask"]}
            seg["prompt_token_ids"], seg["response_token_ids"] = self._token_ids(source)
        return segments

    def _row_temperature(self, traj: Trajectory) -> float:
        """The temperature this row's log-probs are taken at: the one it was sampled with
        (``trajectory["sampling"]``), 1 for greedy rows."""
        sampling = traj.get("sampling")
        if not isinstance(sampling, Mapping) or "temperature" not in sampling:
            raise ConfigError(
                f"trajectory {traj.get('uid')}#{traj.get('sample_index')} does not say how it was sampled: RL training "
                f"scores each row at its own temperature, so the rollout worker must record the SamplingParams it "
                f"sent (trajectory['sampling'] = params.as_record())")
        return SamplingParams(temperature=float(sampling["temperature"])).logprob_temperature

    def _process_trajectories(self, trajectories: list[Trajectory]) -> Batch:
        """Left-padded prompts | right-padded responses, with masks, positions and the temperature
        of each row. A row is one token sequence: a trajectory with several (``segments``) gives
        several rows (``metadata["row_trajectory"]`` maps each row to its trajectory).

        ``response_mask`` is 1 on the response tokens that are trained: every one, unless the
        trajectory's ``loss_mask`` says otherwise (an agent's tool outputs and the chat template's
        glue between turns are in the sequence, so the model sees them, but get no gradient).
        Every loss, advantage and token count downstream reads ``response_mask``."""
        rows = [(i, seg) for i, traj in enumerate(trajectories) for seg in self._segments(traj)]
        max_p = max(len(seg["prompt_token_ids"]) for _, seg in rows)
        max_r = max(max(len(seg["response_token_ids"]) for _, seg in rows), 1)
        n = len(rows)
        input_ids = torch.full((n, max_p + max_r), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, max_p + max_r), dtype=torch.long)
        response_mask = torch.zeros((n, max_r), dtype=torch.float32)
        rollout_logprobs = torch.zeros((n, max_r), dtype=torch.float32)
        have_logprobs = True
        for row, (_, seg) in enumerate(rows):
            p, r = seg["prompt_token_ids"], seg["response_token_ids"]
            input_ids[row, max_p - len(p):max_p] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, max_p - len(p):max_p] = 1
            if r:
                input_ids[row, max_p:max_p + len(r)] = torch.tensor(r, dtype=torch.long)
                attention_mask[row, max_p:max_p + len(r)] = 1
                mask = seg["loss_mask"]
                response_mask[row, :len(r)] = 1.0 if mask is None else torch.tensor(mask, dtype=torch.float32)
            lp = seg["response_logprobs"]
            if lp is not None and len(lp) == len(r):
                rollout_logprobs[row, :len(r)] = torch.tensor(lp, dtype=torch.float32)
            else:
                have_logprobs = False
        row_trajectory = [i for i, _ in rows]
        values = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "responses": input_ids[:, max_p:],
            "response_mask": response_mask,
            "prompts": input_ids[:, :max_p],
            "rewards": torch.tensor([trajectory_reward(trajectories[i]) for i in row_trajectory],
                                    dtype=torch.float32),
            "prompt_groups": _prompt_groups([seg["prompt_token_ids"] for _, seg in rows]),
            "temperature": torch.tensor([self._row_temperature(trajectories[i]) for i in row_trajectory],
                                        dtype=torch.float32),
        }
        if have_logprobs:
            values["rollout_log_probs"] = rollout_logprobs
        max_tokens = [int(t["sampling"]["max_tokens"]) for t in trajectories
                      if isinstance(t.get("sampling"), Mapping) and t["sampling"].get("max_tokens")]
        # Per trajectory, then per row: a row carries its trajectory's domain and cut-off flag.
        last_response = {i: seg["response_token_ids"] for i, seg in rows}  # the turn a token limit cuts off
        truncated = [algorithms.response_truncated(t, len(last_response[i])) for i, t in enumerate(trajectories)]
        meta = {"batch_size": n, "uids": [trajectories[i].get("uid") for i in row_trajectory],
                "domains": [trajectories[i].get("domain") for i in row_trajectory],
                "truncated": [truncated[i] for i in row_trajectory],
                "row_trajectory": row_trajectory, "num_trajectories": len(trajectories),
                "response_tokens": sum(len(seg["response_token_ids"]) for _, seg in rows),
                "prompt_length": max_p, "response_length": max_r, "model_tag": self._model_tag,
                "max_tokens": max(max_tokens) if max_tokens else None}
        return Batch(values, meta)

    @abstractmethod
    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Algorithm-specific preparation: sets ``batch.values["advantages"]`` (one number per row,
        or one per response token) for the default loss; returns the batch and its metrics."""

    def _loss_fn(self, batch: Batch) -> LossFn:
        """The ``loss_fn(log_probs, micro_batch)`` handed to the train service. This default is
        the policy gradient of ``advantages`` (on-policy: one update per batch), averaged over the
        trained tokens; an algorithm with its own loss overrides it."""
        if "advantages" not in batch.values:
            raise ConfigError(f"{type(self).__name__}._prepare_batch set no batch.values['advantages']: the default "
                              f"loss (SelfHostedTrainer._loss_fn) trains on them; set them or override _loss_fn")

        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = agg_loss(-mb["advantages"] * log_probs, mb["response_mask"], "token-mean",
                            batch_num_tokens=mb["batch_num_tokens"])
            return loss, {"pg_loss": float(loss.detach())}
        return loss_fn

    def train(self, trajectories: list[Trajectory]) -> TrainOutput:
        t0 = time.perf_counter()
        batch = self._process_trajectories(trajectories)
        lengths = batch.values["response_mask"].sum(-1)  # before a sample-level mask
        response_mask = batch.values["response_mask"]
        batch, metrics = self._prepare_batch(batch)
        metrics = dict(metrics or {})
        advantages: dict[int, float] = {}
        if "advantages" in batch.values:
            batch.values["advantages"] = _per_token(batch.values["advantages"], response_mask)
            advantages = _sample_advantages(batch.values["advantages"], response_mask,
                                            batch.metadata["row_trajectory"])
        t1 = time.perf_counter()
        tensors = {k: v for k, v in batch.values.items() if isinstance(v, torch.Tensor)}
        # A sample-level mask that left nothing to train on: no optimizer step (Adam's momentum
        # alone would still move the weights).
        skip = not bool(batch.values["response_mask"].any())
        metrics.update({"train/update_skipped": 1.0} if skip else self._update(batch, tensors))
        gaps = _sample_logprob_gaps(batch.metadata[ROW_OUTPUTS], batch.values["responses"],
                                    batch.metadata["row_trajectory"], getattr(self.train_service, "tokenizer", None)) \
            if batch.metadata.get(ROW_OUTPUTS) else {}
        t2 = time.perf_counter()
        meta = batch.metadata
        trained = float(batch.values["response_mask"].sum())
        generated = float(lengths.sum())  # before a sample-level mask
        metrics.update({
            # Counted in trained tokens: what the model generated, not the tool outputs between turns.
            "train/response_length_mean": generated / meta["num_trajectories"],
            "train/trained_tokens": trained,
            "train/untrained_response_tokens_mean": (meta["response_tokens"] - generated) / meta["num_trajectories"],
            "train/sequences_per_trajectory": meta["batch_size"] / meta["num_trajectories"],
            "train/prompt_length": float(meta["prompt_length"]),
            "timing/prepare_s": t1 - t0,
            "timing/update_s": t2 - t1,
        })
        samples = {i: SampleResult(advantage=advantages.get(i), logprob_gap=gaps.get(i))
                   for i in sorted(advantages.keys() | gaps.keys())}
        return TrainOutput(metrics, samples)

    def _update(self, batch: Batch, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """``ppo_epochs`` updates of the model on the batch; the last one's metrics, as ``train/*``
        (the loss's per-row values of the first, from the weights the step started with, go to
        ``batch.metadata[ROW_OUTPUTS]``)."""
        out: dict[str, Any] = {}
        for epoch in range(self._ppo_epochs):
            out = self.service.forward_backward(tensors, self._loss_fn(batch))
            rows = out.pop(ROW_OUTPUTS, None)
            if epoch == 0 and rows:
                batch.metadata[ROW_OUTPUTS] = rows
            out.update(self.service.optim_step())
        return {f"train/{k}": float(v) for k, v in out.items()}

    # -- state ------------------------------------------------------------------------------
    def export_weights(self) -> dict[str, Any]:
        return self.service.export_weights()

    def export_adapter(self, folder: str) -> None:
        self.service.export_adapter(folder)

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        return self.service.score(requests)

    def close(self) -> None:
        if self.train_service is not None:
            self.train_service.close()  # the other ranks of a data-parallel service leave

    def algorithm_state(self) -> dict[str, Any]:
        return {}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def export_checkpoint(cls, checkpoint: str, out: str, dtype: str | None = None, merged: bool = False) -> None:
        export_model_folder(checkpoint, out, dtype, merged=merged)

    def save_model_state(self, folder: str) -> None:
        self.service.save_checkpoint(folder, extra_state={"algorithm": self.algorithm_state()})

    def load_model_state(self, folder: str) -> None:
        self.initialize_workers()
        extra = self.service.load_checkpoint(folder)
        self.load_algorithm_state(extra.get("algorithm", {}))


@dataclass(frozen=True, kw_only=True)
class GrpoSettings(Settings):
    """The ``algorithm.*`` keys ``self_hosted_grpo`` reads itself (the selected estimator and policy loss
    declare theirs, :mod:`nexrl_core.algorithms.registry`)."""

    type: str = setting("grpo", "advantage estimator, by registered name (nexrl_advantage_estimators)")
    policy_loss: str = setting("ppo_clip", "policy loss, by registered name (nexrl_policy_losses)")
    ppo_epochs: int = setting(1, "updates per batch (1: on-policy, the ratio is exactly 1)", ge=1)
    use_kl_in_reward: bool = setting(False, "subtract beta * KL(policy || initial model) from the reward")
    kl_penalty: str = setting("kl", "KL estimator of the reward penalty", choices=tuple(algorithms.KL_KINDS),
                              needs="algorithm.use_kl_in_reward")
    kl_ctrl: algorithms.KlCtrlSettings = setting(algorithms.KlCtrlSettings, "the reward penalty's KL coefficient "
                                                                            "controller",
                                                 needs="algorithm.use_kl_in_reward")
    use_kl_loss: bool = setting(False, "add kl_loss_coef * KL(policy || initial model) to the loss")
    kl_loss_coef: float = setting(0.001, "coefficient of the KL loss term", ge=0, needs="algorithm.use_kl_loss")
    kl_loss_type: str = setting("low_var_kl", "KL estimator of the loss term", choices=tuple(algorithms.KL_KINDS),
                                needs="algorithm.use_kl_loss")
    ref_device: str | None = setting(None, f"device of the frozen KL reference model (null: the policy's; "
                                           f"{DEVICE_HELP})", check=device_problem,
                                     needs=("algorithm.use_kl_in_reward or algorithm.use_kl_loss",
                                            "service.reference_service == null"))
    max_response_length: int | None = setting(None, "loss normaliser of the *-norm aggregation modes "
                                                    "(null: rollout_worker.sampling.max_tokens)", ge=1)
    rollout_correction: algorithms.RolloutCorrectionSettings = setting(
        algorithms.RolloutCorrectionSettings, "truncated importance sampling against the rollout's log-probs")
    objective: Objective = setting("standard", "standard: the policy loss as is; decoupled: AReaL's decoupled PPO "
                                               "for stale samples: the ratio is taken against the proximal policy "
                                               "(the weights the step starts from) and each token's loss is weighted "
                                               "by min(pi_prox / pi_behav, behav_imp_weight_cap), pi_behav the "
                                               "sampler's log-prob of the token")
    behav_imp_weight_cap: float = setting(5.0, "truncation of the decoupled objective's behaviour importance weight "
                                               "pi_prox / pi_behav", ge=1, needs="algorithm.objective == decoupled")
    reward_processing: algorithms.RewardProcessingSettings = setting(
        algorithms.RewardProcessingSettings, "sample-level masks and reward normalisation / clipping / scaling, "
                                             "before advantages; per domain with domains.<name>")


@dataclass(frozen=True)
class GrpoAlgorithm:
    """What a GRPO trainer builds of its ``algorithm`` section, once, in its constructor (a
    selected function may recommend defaults for the trainer's own keys)."""

    selection: algorithms.AlgorithmSelection
    settings: GrpoSettings
    critic: CriticAlgorithmSettings | None  # with an estimator that needs values
    kl_ctrl: algorithms.FixedKLController | algorithms.AdaptiveKLController
    reward_processor: algorithms.RewardProcessor


class SelfHostedGrpoTrainer(SelfHostedTrainer):
    """Policy-gradient RL: advantages from the core's estimator registry (``algorithm.type``), a
    policy loss from the loss registry (``algorithm.policy_loss``), optional KL to the initial
    model in the reward and/or as a loss term, optional rollout correction. An estimator that
    requires values (``gae``) gets a critic, trained alongside the policy (:mod:`nexrl_grpo.critic`); the
    first ``critic_warmup`` steps train only the critic.

    Old log-probs are the trainer's own: with one update per batch (``ppo_epochs`` 1, no KL in
    the reward) they are the current log-probs detached (verl's on-policy shortcut: the ratio is
    exactly 1 and no extra forward runs); otherwise one no-grad forward before the first update
    computes them. Rollout log-probs only feed the mismatch metrics and the correction.

    ``algorithm.objective: decoupled`` (AReaL's decoupled PPO) takes those old log-probs as the
    proximal policy's (the weights the step starts from, once per batch) and weights each token's
    policy loss by :func:`~nexrl_grpo.losses.behaviour_weights`, ``min(pi_prox / pi_behav, cap)``
    against the sampler's log-prob of the token (``response_logprobs``, per token, whatever
    weights drew it).
    """

    ALGORITHM_OPTIONS = {
        **GrpoSettings.options(),
        "adv_estimator": Option(removed="the advantage estimator is algorithm.type (verl's and ROLL's "
                                        "adv_estimator): rename the key"),
    }
    ALGORITHM_SELECTORS = {"type": "advantage_estimator", "policy_loss": "policy_loss"}
    # The KL reference may be service.reference_service instead of a frozen copy held here; the
    # keys that make this trainer compute a KL at all (an Option.needs, checked at validate).
    REFERENCE_SERVICE_NEEDS = "algorithm.use_kl_in_reward or algorithm.use_kl_loss"
    # Values: a critic trained here; its keys are accepted only with an estimator that needs it.
    ALGORITHM_INPUTS = {"values": CRITIC_ALGORITHM_OPTIONS}

    @classmethod
    def check_recipe(cls, recipe: dict[str, Any]) -> list[str]:
        """The decoupled objective weights each token by pi_prox / pi_behav: it needs the sampler's
        log-probs, and the rollout correction would apply that same ratio a second time."""
        algorithm = recipe.get("algorithm")
        if not isinstance(algorithm, Mapping) or algorithm.get("objective") != "decoupled":
            return []
        problems = []
        correction = algorithm.get("rollout_correction")
        if isinstance(correction, Mapping) and correction.get("enabled") is True:
            problems.append("algorithm.rollout_correction.enabled: algorithm.objective: decoupled already weights "
                            "each token by min(pi_prox / pi_behav, behav_imp_weight_cap), the same ratio; "
                            "turn the correction off")
        service = recipe.get("service")
        inference = service.get("inference_service") if isinstance(service, Mapping) else None
        if isinstance(inference, Mapping) and inference.get("request_logprobs") is False:
            problems.append("service.inference_service.request_logprobs: false, but algorithm.objective: decoupled "
                            "weights each token by the sampler's log-prob of it")
        return problems

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        # selection: the estimator, the loss and every algorithm.* value (theirs included); settings:
        # this trainer's own keys. A bad algorithm section fails here, before any model loads.
        selection, settings = self.select_algorithm(GrpoSettings)
        self.selection, self.settings = selection, settings
        critic = CriticAlgorithmSettings.own(selection.options, "algorithm") if selection.requires("values") else None
        self.algorithm = GrpoAlgorithm(selection, settings, critic, algorithms.get_kl_controller(settings.kl_ctrl),
                                       algorithms.RewardProcessor(settings.reward_processing))
        self._ppo_epochs = settings.ppo_epochs
        self._ref_model: torch.nn.Module | None = None
        self.reference_service: Any = None  # service.reference_service's client, when declared
        self.critic: CriticService | None = None

    def initialize_workers(self) -> None:
        algorithm = self.algorithm
        settings = algorithm.settings
        super().initialize_workers()
        policy = self.service
        use_kl = settings.use_kl_in_reward or settings.use_kl_loss
        if use_kl and self.reference_service is None and self._ref_model is None:
            self.reference_service = self.create_reference_service()
        if use_kl and self.reference_service is None and self._ref_model is None:
            device = resolve_device(settings.ref_device) if settings.ref_device else policy.device
            self._ref_model = policy.frozen_copy(device)
        if algorithm.critic is not None and self.critic is None:
            if policy.ranks is not None:
                raise ConfigError(f"algorithm.type '{algorithm.selection.functions['type'].name}' trains a critic in "
                                  f"the trainer's process: service.train_service.world_size must be 1 with it")
            critic = algorithm.critic.critic
            # Its own optimizer settings; Adam's betas/eps and the micro-batch size default to the policy's.
            config = {"lr": critic.lr, "weight_decay": critic.weight_decay, "grad_clip": critic.grad_clip,
                      "betas": policy.config["betas"], "eps": policy.config["eps"],
                      "dtype": policy.dtype,  # auto resolved
                      "device": critic.device or str(policy.device),
                      "micro_batch_size": critic.micro_batch_size or policy.config["micro_batch_size"]}
            self.critic = CriticService(config, model=ValueModel.from_causal_lm(policy.model),
                                        tokenizer=policy.tokenizer)

    def _ref_log_probs(self, batch: Batch) -> torch.Tensor:
        if self.reference_service is not None:
            return self._served_ref_log_probs(batch)
        if self._ref_model is None:
            raise NexRLError(f"{type(self).__name__} has no KL reference yet: call initialize_workers first")
        device = next(self._ref_model.parameters()).device
        v = {k: batch.values[k].to(device) for k in ("input_ids", "attention_mask", "position_ids", "temperature")}
        with torch.no_grad():
            return compute_response_logprobs(self._ref_model, v["input_ids"], v["attention_mask"], v["position_ids"],
                                             batch.values["responses"].shape[1], v["temperature"]).cpu()

    def _served_ref_log_probs(self, batch: Batch) -> torch.Tensor:
        return served_log_probs(self.reference_service, batch)

    def close(self) -> None:
        if self.reference_service is not None:
            self.reference_service.close()
        super().close()

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """ROLL's order: sample-level mask -> reward post-processing -> token-level rewards (with
        the KL penalty) -> advantages (with the critic's values when the estimator needs them).

        Computed per trajectory: a trajectory of several rows (segments) is one sample of its
        group, its outcome reward sits once on its last trained token, token-level recursions
        (GAE, discounted returns) run over its trained tokens end to end, and each of its rows
        gets its part of the result. Untrained tokens (``response_mask`` 0) get no reward, value
        target or advantage."""
        v, algorithm, metrics = batch.values, self.algorithm, {}
        settings = algorithm.settings
        mask = v["response_mask"]
        tensors = {k: x for k, x in v.items() if isinstance(x, torch.Tensor)}
        if self._ppo_epochs > 1 or settings.use_kl_in_reward:
            # Needed before the first update: one no-grad forward, the same computation as training's.
            v["old_log_probs"] = self.service.forward(tensors)
        if settings.use_kl_in_reward or settings.use_kl_loss:
            v["ref_log_probs"] = self._ref_log_probs(batch)
        if self.critic is not None:
            v["old_values"] = self.critic.forward(tensors)
        view = TrajectoryView(batch.metadata["row_trajectory"], mask.shape[1])
        mask_np = view.gather(mask.numpy())
        uids = view.first(batch.metadata["uids"])
        rewards = view.first(v["rewards"].numpy())
        # The seed's order: get_sample_level_mask -> reward_postprocess (per domain) ->
        # compute_token_reward (scores on the last token, KL penalty) -> compute_advantage.
        processed = algorithm.reward_processor(rewards, uids, view.first(batch.metadata["truncated"]),
                                           view.first(batch.metadata["domains"]))
        metrics.update({f"train/{k}": float(x) for k, x in processed.metrics.items()})
        scores = processed.rewards.astype(rewards.dtype)
        token_rewards = algorithms.scores_to_token_level(scores, mask_np)
        v["token_level_scores"] = torch.from_numpy(view.scatter(token_rewards))
        if settings.use_kl_in_reward:
            token_rewards, kl_metrics = algorithms.apply_kl_penalty(
                token_rewards, view.gather(v["old_log_probs"].numpy()), view.gather(v["ref_log_probs"].numpy()),
                mask_np, algorithm.kl_ctrl, settings.kl_penalty)
            metrics.update({f"train/{k}": float(x) for k, x in kl_metrics.items()})
        v["token_level_rewards"] = torch.from_numpy(view.scatter(token_rewards))
        estimate = algorithm.selection.bound("type")
        values = view.gather(v["old_values"].numpy()) if "old_values" in v else None
        adv, returns = estimate(algorithms.AdvantageInputs(token_rewards, mask_np, uids, values))
        v["advantages"] = torch.from_numpy(view.scatter(np.asarray(adv, dtype=np.float32)))
        v["returns"] = torch.from_numpy(view.scatter(np.asarray(returns, dtype=np.float32)))
        # Masked samples leave the loss only (every row of theirs): they still counted in their
        # group's statistics above.
        row_mask = processed.sample_mask.astype(np.float32)[view.index]
        v["response_mask"] = mask * torch.from_numpy(row_mask)[:, None]
        _, group_std, _ = algorithms.group_stats(rewards, uids)
        metrics.update({
            "train/advantages_abs_mean": float(masked_mean(v["advantages"].abs(), mask)),
            "train/group_reward_std_mean": float(group_std.mean()),
            "train/rows_in_flat_groups": float((group_std == 0).mean()),
        })
        return batch, metrics

    def _loss_fn(self, batch: Batch) -> LossFn:
        selection, settings = self.selection, self.settings
        policy_loss = selection.bound("policy_loss")
        correct, cap = settings.rollout_correction.enabled, settings.rollout_correction.cap
        decoupled = settings.objective == "decoupled"
        behav_cap = settings.behav_imp_weight_cap
        max_response_length = self._max_response_length(batch)
        kl_coef = settings.kl_loss_coef if settings.use_kl_loss else 0.0
        kl_kind = settings.kl_loss_type
        # The KL term reduces like the policy loss when the loss declares a mode (a plugin's may not: then per
        # token); the mode is the loss's key, so it is read with the loss's keys.
        options = selection.options
        kl_agg_mode = str(options["loss_agg_mode"] if "loss_agg_mode" in options else KL_AGG_MODE_WITHOUT_LOSS_MODE)
        if correct and "rollout_log_probs" not in batch.values:
            raise ConfigError("algorithm.rollout_correction.enabled: the rollout returned no log-probs to correct "
                              "with (the inference backend must return per-token log-probs)")
        if decoupled and correct:  # nexrl validate refuses it (check_recipe); a trainer built in Python too
            raise ConfigError(self.check_recipe({"algorithm": {"objective": "decoupled",
                                                               "rollout_correction": {"enabled": True}}})[0])
        if decoupled and "rollout_log_probs" not in batch.values:
            raise ConfigError("algorithm.objective: decoupled weights each token by pi_prox / pi_behav, but the rollout "
                              "returned no log-probs (pi_behav: the inference backend must return per-token log-probs)")

        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
            # On-policy shortcut: without a precomputed old log-prob, the current one (detached) is it.
            # It is also the decoupled objective's proximal log-prob: the weights the step started
            # from, computed once per batch (the forward of _prepare_batch with several updates; with
            # one, the weights do not move before this step's optimizer step, so it is exact).
            old = mb["old_log_probs"] if "old_log_probs" in mb else log_probs.detach()
            metrics: dict[str, Any] = {}
            weights = None
            if "rollout_log_probs" in mb:
                trainer_lp, rollout_lp = old.detach().cpu().numpy(), mb["rollout_log_probs"].cpu().numpy()
                mask_np = mb["response_mask"].cpu().numpy()
                metrics.update(algorithms.rollout_mismatch_metrics(trainer_lp, rollout_lp, mask_np))
                gap, position = algorithms.rollout_mismatch_per_row(trainer_lp, rollout_lp, mask_np)
                metrics[ROW_OUTPUTS] = {"logprob_gap": gap, "logprob_gap_position": position}  # for samples.jsonl
                if correct:
                    w, tis_metrics = algorithms.truncated_is_weights(trainer_lp, rollout_lp, mask_np, cap)
                    weights = torch.from_numpy(w).to(log_probs)
                    metrics.update(tis_metrics)
                elif decoupled:
                    weights, behav_metrics = behaviour_weights(old, mb["rollout_log_probs"], mb["response_mask"],
                                                               behav_cap)
                    weights = weights.to(log_probs)
                    metrics.update(behav_metrics)
            context = LossContext(batch_num_seqs=mb["batch_num_seqs"], batch_num_tokens=mb["batch_num_tokens"],
                                  max_response_length=max_response_length, token_weights=weights)
            loss, loss_metrics = policy_loss(log_probs, old, mb["advantages"], mb["response_mask"], context)
            metrics.update(loss_metrics)
            if kl_coef:
                share, metrics["kl_loss"] = kl_loss(log_probs, mb["ref_log_probs"], mb["response_mask"], context,
                                                    kl_kind, kl_agg_mode)
                loss = loss + kl_coef * share
            return loss, metrics
        return loss_fn

    def _max_response_length(self, batch: Batch) -> int | None:
        return self.settings.max_response_length or batch.metadata["max_tokens"]

    def _update(self, batch: Batch, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """The critic's updates first (its values made the advantages), then the policy's, unless
        this step is one of the first ``critic_warmup``."""
        if self.critic is None:
            return super()._update(batch, tensors)
        out: dict[str, float] = {}
        for _ in range(self._ppo_epochs):
            out = self.critic.forward_backward(tensors, self._value_loss_fn(batch))
            out.update(self.critic.optim_step())
        metrics = {f"critic/{k}": float(x) for k, x in out.items()}
        mask = batch.values["response_mask"]
        metrics["critic/returns_mean"] = float(masked_mean(batch.values["returns"], mask))
        metrics["critic/values_mean"] = float(masked_mean(batch.values["old_values"], mask))
        critic = self.algorithm.critic
        warming_up = critic is not None and self.global_step < critic.critic_warmup
        metrics["critic/warmup"] = float(warming_up)
        return metrics if warming_up else {**metrics, **super()._update(batch, tensors)}

    def _value_loss_fn(self, batch: Batch) -> LossFn:
        settings = self.algorithm.critic
        if settings is None:
            raise NexRLError(f"algorithm.type '{self.selection.functions['type'].name}' trains no critic")
        value_clip, mode = settings.critic.value_clip, settings.critic.loss_agg_mode
        max_response_length = self._max_response_length(batch)

        def loss_fn(values: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
            context = LossContext(batch_num_seqs=mb["batch_num_seqs"], batch_num_tokens=mb["batch_num_tokens"],
                                  max_response_length=max_response_length)
            return value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], context, value_clip, mode)
        return loss_fn

    def algorithm_state(self) -> dict[str, Any]:
        algorithm = self.algorithm
        return {"kl_coef": float(algorithm.kl_ctrl.value), "reward_running": algorithm.reward_processor.state_dict()}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        algorithm = self.algorithm
        if "kl_coef" in state:
            algorithm.kl_ctrl.value = float(state["kl_coef"])
        algorithm.reward_processor.load_state_dict(state.get("reward_running", {}))

    def save_model_state(self, folder: str) -> None:
        super().save_model_state(folder)
        if self.critic is not None:
            self.critic.save_checkpoint(Path(folder) / CRITIC_FOLDER)

    def load_model_state(self, folder: str) -> None:
        super().load_model_state(folder)
        if self.critic is not None:
            critic_folder = Path(folder) / CRITIC_FOLDER
            if not critic_folder.is_dir():
                raise ConfigError(f"{folder}: the checkpoint has no critic ({CRITIC_FOLDER}/), but algorithm.type "
                                  f"'{self.selection.functions['type'].name}' trains one: resume it with the "
                                  f"estimator it was written with")
            self.critic.load_checkpoint(critic_folder)


class SelfHostedCrossEntropyTrainer(SelfHostedTrainer):
    """Supervised fine-tuning on trajectories' responses (e.g. from the pig_latin worker).

    Trajectories without token ids are tokenized here with the model's chat template:
    for SFT the text is the data, not a sample to be scored.
    """

    TRAJECTORY_CONTRACT = "sft"

    def _token_ids(self, traj: Trajectory) -> tuple[list[int], list[int]]:
        if traj.get("prompt_token_ids") is not None and traj.get("response_token_ids") is not None:
            return super()._token_ids(traj)
        tok = self.service.tokenizer
        prompt = traj["prompt"]
        if isinstance(prompt, list):
            # As the engine encodes chat prompts (HFInferenceEngine.encode_prompt). Not tokenize=True:
            # transformers 5 returns a BatchEncoding there (not a dict: list() of it gives its keys).
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tok(str(prompt), add_special_tokens=False)["input_ids"]
        response_ids = tok(str(traj["response"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return list(prompt_ids), response_ids

    def _row_temperature(self, traj: Trajectory) -> float:
        return 1.0  # the likelihood of the data itself: no sampling temperature applies

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return batch, {}

    def _loss_fn(self, batch: Batch) -> LossFn:
        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
            nll = -log_probs
            loss = agg_loss(nll, mb["response_mask"], "token-mean", batch_num_tokens=mb["batch_num_tokens"])
            return loss, {"nll": float(masked_mean(nll.detach(), mb["response_mask"]))}
        return loss_fn
