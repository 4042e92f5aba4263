"""Remote-API trainers (the seed's ``RemoteApiTrainer`` family): trajectories -> datums -> a train
service over ``tinker.types.Datum`` batches (``service.train_service.backend: tinker``).

One step: :meth:`RemoteApiTrainer._prepare_trajectories` (the algorithm: advantages, ...) ->
:meth:`~RemoteApiTrainer._convert_trajectories_to_datums` -> ``forward_backward`` and
``optim_step`` submitted back to back and awaited together (:meth:`nexrl_core.TrainService.train_step`).
After the step, :meth:`~RemoteApiTrainer.export_weights` is a sampling client of the new weights,
which the ``tinker`` weight sync hands to the ``tinker`` inference backend.

- ``remote_api_grpo`` (:class:`RemoteApiGrpoTrainer`): advantages from the core's estimator
  registry (``algorithm.type``, as for ``self_hosted_grpo``), losses ``importance_sampling`` or
  ``ppo`` (``algorithm.loss_fn``), computed by the service against the rollout's log-probs.
- ``remote_api_cross_entropy`` (:class:`RemoteApiCrossEntropyTrainer`): supervised training on the
  trajectories' responses (loss ``cross_entropy``).
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from loguru import logger

from nexrl_core import (
    BaseTrainer,
    Capabilities,
    ConfigError,
    DataError,
    NexRLError,
    Option,
    SampleResult,
    SamplingParams,
    Settings,
    StepResult,
    TrainerParts,
    TrainOutput,
    Trajectory,
    algorithms,
    setting,
    trajectory_reward,
    trajectory_segments,
)

from .datums import RL_LOSSES, response_values, trajectory_to_datums
from .service import BATCH_FORMAT, TinkerTrainService
from .tokens import encode_prompt, load_tokenizer
from .weights import SYNC_CAPABILITY, TRAINER_CAPABILITY

# The only temperature the service scores tokens at (its losses take no temperature).
SERVICE_TEMPERATURE = 1.0


def _name(trajectory: Trajectory) -> str:
    return f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index', 0)}"


def _segments(trajectory: Trajectory) -> list[dict[str, Any]]:
    """The token sequences ``trajectory`` trains on (one, or an agent rollout's ``segments``)."""
    try:
        return trajectory_segments(trajectory)
    except ValueError as exc:
        raise DataError(str(exc)) from None


def _segment_mask(segment: dict[str, Any]) -> np.ndarray:
    """1 per response token of one sequence that is trained: its ``loss_mask``, else all."""
    mask = segment["loss_mask"]
    n = len(segment["response_token_ids"] or [])
    return np.ones(n, dtype=np.float32) if mask is None else np.asarray(mask, dtype=np.float32)


def _response_mask(trajectory: Trajectory) -> np.ndarray:
    """1 per response token that is trained, over every sequence of the trajectory end to end (what
    the per-token advantages of :func:`nexrl_tinker.datums.trajectory_to_datums` run over)."""
    masks = [_segment_mask(seg) for seg in _segments(trajectory)]
    return np.concatenate(masks) if masks else np.zeros(0, dtype=np.float32)


def _padded(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Rows of different lengths as one zero-padded ``[B, T]`` array (``T`` at least 1)."""
    out = np.zeros((len(rows), max([len(r) for r in rows] + [1])), dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def rng_state() -> dict[str, Any]:
    """Python's and numpy's global RNG states as JSON."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": list(state), "gauss_next": gauss},
            "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}}


def set_rng_state(state: Mapping[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    np.random.set_state((npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))


class RemoteApiTrainer(BaseTrainer):
    """Base of the remote-API trainers: subclasses implement :meth:`_prepare_trajectories` and say
    which loss the service computes (:meth:`loss`)."""

    TRAIN_SERVICE_BATCH_FORMAT = BATCH_FORMAT
    TRAIN_SERVICE_DEFAULT = "tinker"
    TRAJECTORY_CONTRACT = "remote_api"
    # The weights live on the service: rollouts must sample them through the tinker weight sync.
    CAPABILITIES = Capabilities(
        provides={TRAINER_CAPABILITY},
        requires={SYNC_CAPABILITY: "it trains on the Tinker service, and without the tinker weight sync rollouts "
                                   "keep sampling the initial model"})

    @classmethod
    def network_use(cls, recipe: dict[str, Any]) -> str | None:
        """ray.private_network: the train service it drives is remote."""
        return "trains on a remote train service (Tinker)"
    ALGORITHM_OPTIONS: dict[str, Option] = {}

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        self.train_service: TinkerTrainService | None = None

    def initialize_workers(self) -> None:
        """Build the train service (nothing is contacted until the first call)."""
        if self.train_service is None:
            service = self.create_train_service()
            if not isinstance(service, TinkerTrainService):
                raise ConfigError(f"service.train_service.backend: {type(self).__name__} trains through the Tinker "
                                  f"train service (its sampler snapshots and remote checkpoints), not "
                                  f"{type(service).__name__}")
            self.train_service = service

    @property
    def service(self) -> TinkerTrainService:
        """The train service :meth:`initialize_workers` built."""
        if self.train_service is None:
            raise NexRLError(f"{type(self).__name__} has no train service yet: call initialize_workers first")
        return self.train_service

    # -- the algorithm ----------------------------------------------------------------------
    @abstractmethod
    def _prepare_trajectories(self, trajectories: list[Trajectory], metrics: dict[str, Any]) -> list[Trajectory]:
        """Algorithm-specific preparation (advantages...): returns the trajectories to train on,
        and adds its metrics (``train/...``) to ``metrics``. ``trajectories`` are this step's own
        copies of the pool's (keys may be set on them: the pool's stay as they were)."""

    def loss(self) -> tuple[str, dict[str, float] | None]:
        """The service's loss function for this step: its name and ``loss_fn_config``. This
        default is ``importance_sampling`` on each trajectory's ``advantages`` (one number, or one
        per response token), which ``_prepare_trajectories`` sets: a trainer written as the seed's
        guide shows overrides only that."""
        return "importance_sampling", None

    def _convert_trajectories_to_datums(self, trajectories: list[Trajectory]) -> list[Any]:
        """One ``tinker.types.Datum`` per token sequence for :meth:`loss` (:mod:`nexrl_tinker.datums`):
        one per trajectory, several for an agent rollout of several sequences (``segments``)."""
        name, _ = self.loss()
        return [d for t in trajectories for d in trajectory_to_datums(t, name)]

    def _output_metrics(self, trajectories: list[Trajectory], datums: list[Any], result: StepResult
                        ) -> dict[str, float]:
        """Metrics from the service's per-datum outputs (the log-probs it computed)."""
        return {}

    def _sample_results(self, trajectories: list[Trajectory], datums: list[Any], result: StepResult
                        ) -> dict[int, SampleResult]:
        """What the step computed per sample, by the index of the sample in the list :meth:`train`
        was given (``trajectories`` are the prepared ones)."""
        return {}

    # -- one step ----------------------------------------------------------------------------
    def train(self, trajectories: list[Trajectory]) -> TrainOutput:
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        # Shallow copies: a _prepare_trajectories written as the seed's guide shows sets keys on them.
        trajectories = self._prepare_trajectories([cast(Trajectory, dict(t)) for t in trajectories], metrics)
        if not trajectories:  # a sample-level mask left nothing to train on: no optimizer step
            return TrainOutput({**metrics, "train/update_skipped": 1.0, "timing/prepare_s": time.perf_counter() - t0})
        datums = self._convert_trajectories_to_datums(trajectories)
        name, config = self.loss()
        t1 = time.perf_counter()
        result = self.service.train_step(datums, name, config)  # submitted back to back, awaited together
        t2 = time.perf_counter()
        metrics.update({f"train/{k}": float(v) for k, v in result.metrics.items()})
        metrics.update({f"train/{k}": v for k, v in self._output_metrics(trajectories, datums, result).items()})
        trained = [float(_response_mask(t).sum()) for t in trajectories]
        metrics.update({
            "train/response_length_mean": float(np.mean(trained)) if trained else 0.0,  # trained tokens
            "train/sequences_per_trajectory": len(datums) / len(trajectories),
            "train/num_tokens": float(sum(d.model_input.length for d in datums)),
            "timing/prepare_s": t1 - t0,
            "timing/update_s": t2 - t1,
        })
        return TrainOutput(metrics, self._sample_results(trajectories, datums, result))

    # -- state --------------------------------------------------------------------------------
    def export_weights(self) -> Any:
        """A sampling client of the current weights (what the tinker weight sync hands over)."""
        self.initialize_workers()
        return self.service.sampling_client()

    def algorithm_state(self) -> dict[str, Any]:
        return {}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        pass

    def save_model_state(self, folder: str) -> None:
        self.service.save_state(folder, extra_state={"algorithm": self.algorithm_state(), "rng": rng_state()})

    def load_model_state(self, folder: str) -> None:
        self.initialize_workers()
        extra = self.service.load_state(folder)
        self.load_algorithm_state(extra.get("algorithm", {}))
        if "rng" in extra:
            set_rng_state(extra["rng"])

    def close(self) -> None:
        if self.train_service is not None:
            self.train_service.close()


@dataclass(frozen=True, kw_only=True)
class RemoteGrpoSettings(Settings):
    """The ``algorithm.*`` keys ``remote_api_grpo`` reads itself (the selected estimator declares its own)."""

    type: str = setting("grpo", "advantage estimator, by registered name (nexrl_advantage_estimators)")
    loss_fn: str = setting("importance_sampling", "the service's policy loss: importance_sampling (-ratio * A) or "
                                                  "ppo (clipped ratio)", choices=RL_LOSSES)
    clip_ratio_low: float | None = setting(None, "ppo: the ratio is clipped below at 1 - clip_ratio_low (null: 0.2)",
                                           ge=0, lt=1)
    clip_ratio_high: float | None = setting(None, "ppo: the ratio is clipped above at 1 + clip_ratio_high (null: "
                                                  "0.2)", ge=0)
    reward_processing: algorithms.RewardProcessingSettings = setting(
        algorithms.RewardProcessingSettings, "sample-level masks and reward normalisation / clipping / scaling, "
                                             "before advantages; per domain with domains.<name>")


class RemoteApiGrpoTrainer(RemoteApiTrainer):
    """GRPO-family RL through a remote API: advantages from the core's estimator registry
    (``algorithm.type``, the same functions ``self_hosted_grpo`` uses), grouped by ``uid``; the
    service's ``importance_sampling`` or ``ppo`` loss against the rollout's log-probs.

    The service scores tokens at temperature 1 only, so every trajectory must have been sampled at
    temperature 1 (or greedily, whose log-probs are those at temperature 1): the trainer reads the
    sampling record each trajectory carries (``trajectory["sampling"]``) and refuses others.
    """

    ALGORITHM_OPTIONS = RemoteGrpoSettings.options()
    ALGORITHM_SELECTORS = {"type": "advantage_estimator"}
    DEFAULT_CLIP_RATIO = 0.2

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        # selection: the estimator and every algorithm.* value (its own included); settings: this
        # trainer's own keys. A bad algorithm section fails here, before the service is built.
        self.selection, self.settings = self.select_algorithm(RemoteGrpoSettings)
        self.reward_processor = algorithms.RewardProcessor(self.settings.reward_processing)  # with its running state
        self._prepared_from: list[int] = []  # the index of the pool's trajectory behind each prepared one
        self._advantages: dict[int, float] = {}  # by that index: the mean advantage of its trained tokens

    @classmethod
    def algorithm_option_problems(cls, options: Mapping[str, Any]) -> list[str]:
        if options.get("loss_fn") != "ppo":
            return [f"algorithm.{key}: read only with algorithm.loss_fn: ppo (loss_fn is "
                    f"{options.get('loss_fn')!r}); delete it" for key in ("clip_ratio_low", "clip_ratio_high")
                    if options.get(key) is not None]
        return []

    @classmethod
    def check_recipe(cls, recipe: Mapping[str, Any]) -> list[str]:
        """Rollouts sampled at a temperature the service cannot score at would train on a wrong ratio."""
        rollout = recipe.get("rollout_worker")
        sampling = rollout.get("sampling") if isinstance(rollout, Mapping) else None
        temperature = sampling.get("temperature") if isinstance(sampling, Mapping) else None
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature not in (0, 1):
            return [f"rollout_worker.sampling.temperature: {temperature}, but {cls._temperature_reason()}; sample at "
                    f"temperature 1.0 (or 0, greedy)"]
        return []

    @staticmethod
    def _temperature_reason() -> str:
        return ("the Tinker service scores tokens at temperature 1 only, so the importance ratio of "
                "algorithm.loss_fn would compare two different distributions")

    def algorithm_state(self) -> dict[str, Any]:
        return {"reward_running": self.reward_processor.state_dict()}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self.reward_processor.load_state_dict(state.get("reward_running", {}))

    def loss(self) -> tuple[str, dict[str, float] | None]:
        settings = self.settings
        if settings.loss_fn != "ppo":
            return settings.loss_fn, None
        low = settings.clip_ratio_low if settings.clip_ratio_low is not None else self.DEFAULT_CLIP_RATIO
        high = settings.clip_ratio_high if settings.clip_ratio_high is not None else self.DEFAULT_CLIP_RATIO
        return settings.loss_fn, {"clip_low_threshold": 1.0 - low, "clip_high_threshold": 1.0 + high}

    def _check_sampling(self, trajectory: Trajectory) -> None:
        sampling = trajectory.get("sampling")
        if not isinstance(sampling, Mapping) or "temperature" not in sampling:
            raise DataError(f"{_name(trajectory)} does not say how it was sampled: RL training needs the rollout "
                            f"worker to record the SamplingParams it sent (trajectory['sampling'] = "
                            f"params.as_record())")
        temperature = SamplingParams(temperature=float(sampling["temperature"])).logprob_temperature
        if temperature != SERVICE_TEMPERATURE:
            raise DataError(f"{_name(trajectory)} was sampled at temperature {sampling['temperature']}, but "
                            f"{self._temperature_reason()}; sample at temperature 1.0 "
                            f"(rollout_worker.sampling.temperature)")

    def _prepare_trajectories(self, trajectories: list[Trajectory], metrics: dict[str, Any]) -> list[Trajectory]:
        for t in trajectories:
            self._check_sampling(t)
        masks = [_response_mask(t) for t in trajectories]
        mask = _padded(masks)
        rewards = np.asarray([trajectory_reward(t) for t in trajectories], dtype=np.float64)
        group_ids = [t.get("uid") for t in trajectories]
        estimate = self.selection.bound("type")
        # The seed's order, as in self_hosted_grpo: sample-level mask -> reward post-processing (per
        # domain) -> token-level reward -> advantages.
        truncated = np.asarray([algorithms.response_truncated(t, len(t.get("response_token_ids") or []))
                                for t in trajectories], dtype=bool)
        processed = self.reward_processor(rewards, group_ids, truncated, [t.get("domain") for t in trajectories])
        metrics.update({f"train/{k}": float(x) for k, x in processed.metrics.items()})
        token_rewards = algorithms.scores_to_token_level(processed.rewards, mask)
        advantages, _ = estimate(algorithms.AdvantageInputs(token_rewards, mask, group_ids))
        advantages = np.asarray(advantages, dtype=np.float64)
        # A masked sample leaves the loss (it still counted in its group's statistics above).
        prepared = [{**t, "advantages": row[:len(m)].tolist()}
                    for t, row, m, keep in zip(trajectories, advantages, masks, processed.sample_mask) if keep]
        # The sample behind each prepared one: samples.jsonl records its log-prob gap and its mean
        # advantage over its trained tokens (as self_hosted_grpo records them).
        self._prepared_from = [i for i, keep in enumerate(processed.sample_mask) if keep]
        self._advantages = {i: float((advantages[i] * mask[i]).sum() / mask[i].sum())
                            for i in self._prepared_from if mask[i].any()}
        _, group_std, _ = algorithms.group_stats(rewards, group_ids)
        valid = mask > 0
        metrics.update({
            "train/advantages_abs_mean": float(np.abs(advantages)[valid].mean()) if valid.any() else 0.0,
            "train/group_reward_std_mean": float(group_std.mean()) if len(group_std) else 0.0,
            "train/rows_in_flat_groups": float((group_std == 0).mean()) if len(group_std) else 0.0,
        })
        return cast(list[Trajectory], prepared)

    def _output_metrics(self, trajectories: list[Trajectory], datums: list[Any], result: StepResult
                        ) -> dict[str, float]:
        """The rollout-vs-service log-prob mismatch of the trained tokens (the service's log-probs
        are those of the weights the step started from)."""
        found = _logprob_rows(trajectories, datums, result)
        return {} if found is None else algorithms.rollout_mismatch_metrics(*found)

    def _sample_results(self, trajectories: list[Trajectory], datums: list[Any], result: StepResult
                        ) -> dict[int, SampleResult]:
        """Each sample's mean advantage and its own largest log-prob gap (as the self-hosted trainers
        record them; the gap without the token's text: this trainer holds no tokenizer)."""
        found = _logprob_rows(trajectories, datums, result)
        gaps: dict[int, dict[str, Any]] = {}
        if found is not None and len(self._prepared_from) == len(trajectories):
            per_row, positions = algorithms.rollout_mismatch_per_row(*found)
            owners = [i for i, t in enumerate(trajectories) for _ in _segments(t)]
            gaps = {self._prepared_from[i]: record
                    for i, (_, record) in algorithms.sample_logprob_gaps(per_row, positions, owners).items()}
        return {i: SampleResult(advantage=self._advantages.get(i), logprob_gap=gaps.get(i))
                for i in sorted(self._advantages.keys() | gaps.keys())}


def _logprob_rows(trajectories: list[Trajectory], datums: list[Any], result: StepResult
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The service's and the rollout's log-probs of each datum's response tokens and its trained
    tokens, as padded ``[datums, T]`` arrays; None when the outputs do not match the datums."""
    segments = [seg for t in trajectories for seg in _segments(t)]  # one per datum, in order
    if len(result.outputs) != len(datums) or len(segments) != len(datums):
        return None
    trainer, rollout, masks = [], [], []
    for seg, datum, out in zip(segments, datums, result.outputs):
        r = len(seg["response_token_ids"])
        trainer.append(response_values(datum, out["logprobs"], r))
        rollout.append(np.asarray(seg["response_logprobs"], dtype=np.float64))
        masks.append(_segment_mask(seg))
    return _padded(trainer), _padded(rollout), _padded(masks)


@dataclass(frozen=True, kw_only=True)
class RemoteSftSettings(Settings):
    """The ``trainer.*`` keys of ``remote_api_cross_entropy`` beside the core's."""

    tokenizer_path: str | None = setting(None, "local tokenizer folder for trajectories that carry text but no token "
                                               "ids (null: service.inference_service.tokenizer_path)")


class RemoteApiCrossEntropyTrainer(RemoteApiTrainer):
    """Supervised training through a remote API (loss ``cross_entropy``) on the trajectories'
    responses, e.g. from the ``pig_latin`` rollout worker.

    Trajectories without token ids (text data) are tokenized here, with the tokenizer in
    ``trainer.tokenizer_path`` (else ``service.inference_service.tokenizer_path``): the prompt as
    the ``tinker`` inference backend encodes it (chat template), the response followed by EOS.
    """

    TRAJECTORY_CONTRACT = "sft"
    SETTINGS = RemoteSftSettings
    # Its data need not come from the model being trained: it works with any weight sync.
    CAPABILITIES = Capabilities(provides={TRAINER_CAPABILITY})

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        self.settings = RemoteSftSettings.own(self._config, "trainer")
        # The inference backend's tokenizer settings, where it declares them (tinker, hf).
        inference = self._full_config["service"]["inference_service"]
        self._tokenizer_path = self.settings.tokenizer_path or \
            (inference["tokenizer_path"] if "tokenizer_path" in inference else None)
        self._chat_template = bool(inference["chat_template"]) if "chat_template" in inference else True
        self._tokenizer: Any = None

    def loss(self) -> tuple[str, dict[str, float] | None]:
        return "cross_entropy", None

    def _tokenized(self, trajectory: Trajectory) -> Trajectory:
        if trajectory.get("prompt_token_ids") is not None and trajectory.get("response_token_ids") is not None:
            return trajectory
        if not self._tokenizer_path:
            raise ConfigError(f"trainer.tokenizer_path: {_name(trajectory)} has text but no token ids; set "
                              f"trainer.tokenizer_path (a local folder with the model's tokenizer) to tokenize it")
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(str(self._tokenizer_path), "trainer.tokenizer_path")
            logger.info(f"tokenizing text trajectories with the tokenizer in {self._tokenizer_path}")
        tok = self._tokenizer
        if "prompt" not in trajectory or "response" not in trajectory:
            raise DataError(f"{_name(trajectory)} has neither token ids nor prompt and response text")
        prompt_ids = encode_prompt(tok, trajectory["prompt"], self._chat_template)
        response_ids = list(tok(str(trajectory["response"]), add_special_tokens=False).input_ids) + [tok.eos_token_id]
        return {**trajectory, "prompt_token_ids": prompt_ids, "response_token_ids": response_ids}

    def _prepare_trajectories(self, trajectories: list[Trajectory], metrics: dict[str, Any]) -> list[Trajectory]:
        return [self._tokenized(t) for t in trajectories]

    def _output_metrics(self, trajectories: list[Trajectory], datums: list[Any], result: StepResult
                        ) -> dict[str, float]:
        """``nll``: the mean negative log-likelihood of the weighted response tokens (before the step)."""
        total = count = 0.0
        for datum, out in zip(datums, result.outputs):
            weights = np.asarray(datum.loss_fn_inputs["weights"].to_numpy(), dtype=np.float64)
            logprobs = np.asarray(out["logprobs"], dtype=np.float64)
            total -= float((logprobs * weights).sum())
            count += float(weights.sum())
        return {"nll": total / count} if count else {}
