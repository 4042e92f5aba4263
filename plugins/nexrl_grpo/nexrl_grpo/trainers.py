"""Self-hosted trainers: trajectories -> padded tensors -> algorithm -> local torch train service."""

from __future__ import annotations

import copy
import time
from abc import abstractmethod
from typing import Any

import torch
from loguru import logger
from omegaconf import OmegaConf

from nexrl_core import Batch, BaseTrainer, Capabilities, ConfigError, Option, Trajectory

from . import core_algos
from .modeling import compute_response_logprobs, position_ids_from_mask
from .train_service import LocalTorchTrainService
from .weights import AUTO_FLAG, MODEL_OPTIONS, _auto_flag, check_model_section, config_errors, resolve_model_path


def _betas(value: Any) -> str | None:
    return None if len(value) == 2 and all(0 <= b < 1 for b in value) else \
        f"expected [beta1, beta2], each in [0, 1), got {list(value)}"


TRAIN_SERVICE_OPTIONS = {
    # The core checks the value against the train services it knows.
    "backend": Option("local_torch", str, "the train service: local_torch (torch in this process)"),
    **MODEL_OPTIONS,
    "lr": Option(1e-6, float, "AdamW learning rate", gt=0),
    "weight_decay": Option(0.0, float, "AdamW weight decay", ge=0),
    "betas": Option([0.9, 0.999], list[float], "AdamW betas", check=_betas),
    "eps": Option(1e-8, float, "AdamW epsilon", gt=0),
    "grad_clip": Option(1.0, float, "gradient-norm clip (<= 0 or null: none)"),
    "seed": Option(None, int, "seed of torch, numpy and python RNGs (default: the recipe's seed)"),
    "micro_batch_size": Option(None, int, "rows per forward pass (null: the whole batch)", ge=1),
    "temperature": Option(1.0, float, "logits are divided by it when scoring", gt=0),
    "packing": Option(None, AUTO_FLAG, "packed sequences without padding: auto | true | false", check=_auto_flag),
    "max_tokens_per_pack": Option(2048, int, "tokens per packed sequence", ge=1),
}


def _prompt_groups(prompts: list[list[int]]) -> torch.Tensor:
    """Rows with identical prompt tokens get one id, so the model runs each distinct prompt once."""
    ids: dict[tuple[int, ...], int] = {}
    return torch.tensor([ids.setdefault(tuple(p), len(ids)) for p in prompts], dtype=torch.long)


class SelfHostedTrainer(BaseTrainer):
    """Turns trajectories into verl-layout tensors; subclasses add the algorithm in ``_prepare_batch``."""

    TRAIN_SERVICE_OPTIONS = TRAIN_SERVICE_OPTIONS
    ALGORITHM_KEYS: dict[str, Any] = {}
    # New weights exist as tensors in this process: a weight-sync backend must bring them to inference.
    CAPABILITIES = Capabilities(
        provides={"trainer:state_dict"},
        requires={"weight_sync:state_dict": "it trains new weights in this process, and without a backend that "
                                            "moves them, rollouts keep sampling the initial model"})
    check_train_service = staticmethod(check_model_section)

    def __init__(self, config: Any):
        super().__init__(config)
        self._service_config = config.service.train_service
        self._algorithm = config.get("algorithm", {}) or {}
        self.train_service: LocalTorchTrainService | None = None
        self.pad_token_id = 0
        self._ppo_epochs = int(self._algorithm.get("ppo_epochs", 1) or 1)

    def initialize_workers(self) -> None:
        if self.train_service is not None:
            return
        cfg = OmegaConf.to_container(self._service_config, resolve=True)
        cfg["model_path"] = resolve_model_path(cfg.get("model_path"), cfg.get("gguf_file"))
        cfg.pop("gguf_file", None)
        if cfg.get("seed") is None:
            cfg["seed"] = int(self._full_config.seed)
        if cfg.get("num_threads"):
            torch.set_num_threads(int(cfg["num_threads"]))
        t0 = time.perf_counter()
        with config_errors("service.train_service"):
            self.train_service = LocalTorchTrainService(cfg)
        tok = self.train_service.tokenizer
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        logger.info(f"train service ready ({cfg['model_path']}, {time.perf_counter() - t0:.1f}s)")

    # -- trajectories -> tensors -------------------------------------------------------
    def _token_ids(self, traj: Trajectory) -> tuple[list[int], list[int]]:
        prompt_ids, response_ids = traj.get("prompt_token_ids"), traj.get("response_token_ids")
        if prompt_ids is None or response_ids is None:
            raise ConfigError(
                f"trajectory {traj.get('uid')}#{traj.get('sample_index')} has no token ids: self-hosted training "
                f"needs the inference backend to return prompt and response token ids (vLLM: return_token_ids)")
        return list(prompt_ids), list(response_ids)

    def _process_trajectories(self, trajectories: list[Trajectory]) -> Batch:
        """Left-padded prompts | right-padded responses, with masks, positions and loss mask."""
        pairs = [self._token_ids(t) for t in trajectories]
        max_p = max(len(p) for p, _ in pairs)
        max_r = max(max(len(r) for _, r in pairs), 1)
        n = len(pairs)
        input_ids = torch.full((n, max_p + max_r), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, max_p + max_r), dtype=torch.long)
        response_mask = torch.zeros((n, max_r), dtype=torch.float32)
        old_logprobs = torch.zeros((n, max_r), dtype=torch.float32)
        have_logprobs = True
        for i, ((p, r), traj) in enumerate(zip(pairs, trajectories)):
            input_ids[i, max_p - len(p):max_p] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, max_p - len(p):max_p] = 1
            if r:
                input_ids[i, max_p:max_p + len(r)] = torch.tensor(r, dtype=torch.long)
                attention_mask[i, max_p:max_p + len(r)] = 1
                response_mask[i, :len(r)] = 1.0
            lp = traj.get("response_logprobs")
            if lp is not None and len(lp) == len(r):
                old_logprobs[i, :len(r)] = torch.tensor(lp, dtype=torch.float32)
            else:
                have_logprobs = False
        values = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "responses": input_ids[:, max_p:],
            "response_mask": response_mask,
            "prompts": input_ids[:, :max_p],
            "loss_mask": response_mask,
            "rewards": torch.tensor([float(t.get("reward", 0.0)) for t in trajectories], dtype=torch.float32),
            "prompt_groups": _prompt_groups([p for p, _ in pairs]),
        }
        if have_logprobs:
            values["rollout_log_probs"] = old_logprobs
        meta = {"batch_size": n, "uids": [t.get("uid") for t in trajectories], "prompt_length": max_p,
                "response_length": max_r, "model_tag": self._model_tag}
        return Batch(values, meta)

    @abstractmethod
    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Algorithm-specific preparation (advantages, KL, ...)."""

    @abstractmethod
    def _loss_fn(self, batch: Batch):
        """The ``loss_fn(log_probs, micro_batch)`` handed to the train service."""

    def train(self, trajectories: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self._process_trajectories(trajectories)
        batch, metrics = self._prepare_batch(batch)
        t1 = time.perf_counter()
        tensors = {k: v for k, v in batch.values.items() if isinstance(v, torch.Tensor)}
        for _ in range(self._ppo_epochs):
            out = self.train_service.forward_backward(tensors, self._loss_fn(batch))
            out.update(self.train_service.optim_step())
        t2 = time.perf_counter()
        lengths = batch.values["response_mask"].sum(-1)
        metrics.update({f"train/{k}": float(v) for k, v in out.items()})
        metrics.update({
            "train/response_length_mean": float(lengths.mean()),
            "train/prompt_length": float(batch.metadata["prompt_length"]),
            "timing/prepare_s": t1 - t0,
            "timing/update_s": t2 - t1,
        })
        return metrics

    # -- state ------------------------------------------------------------------------------
    def export_weights(self) -> dict[str, Any]:
        return self.train_service.export_weights()

    def algorithm_state(self) -> dict[str, Any]:
        return {}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        pass

    def save_model_state(self, folder: str) -> None:
        self.train_service.save_checkpoint(folder, extra_state={"algorithm": self.algorithm_state()})

    def load_model_state(self, folder: str) -> None:
        self.initialize_workers()
        extra = self.train_service.load_checkpoint(folder)
        self.load_algorithm_state(extra.get("algorithm", {}))


class SelfHostedGrpoTrainer(SelfHostedTrainer):
    """GRPO: group-relative advantages, PPO-clip loss, optional KL penalty in the reward."""

    ALGORITHM_KEYS = {"type": "grpo", "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.2,
                      "clip_ratio_high": 0.2, "norm_adv_by_std": True, "epsilon": 1e-6,
                      "do_old_log_prob_compute": False, "use_kl_in_reward": False, "kl_penalty": "kl",
                      "kl_ctrl": {}, "max_response_length": None, "ppo_epochs": 1}

    def __init__(self, config: Any):
        super().__init__(config)
        algo = self._algorithm
        self._loss_agg_mode = str(algo.get("loss_agg_mode", "seq-mean-token-mean"))
        if self._loss_agg_mode not in core_algos.LOSS_AGG_MODES:
            raise ConfigError(f"algorithm.loss_agg_mode: '{self._loss_agg_mode}' is not one of "
                              f"{', '.join(core_algos.LOSS_AGG_MODES)}")
        self._use_kl_in_reward = bool(algo.get("use_kl_in_reward", False))
        self._kl_ctrl = core_algos.get_kl_controller(algo.get("kl_ctrl", {}) or {})
        self._max_response_length = algo.get("max_response_length") or \
            config.rollout_worker.get("sampling", {}).get("max_tokens")
        self._ref_model: torch.nn.Module | None = None

    def initialize_workers(self) -> None:
        super().initialize_workers()
        if self._use_kl_in_reward and self._ref_model is None:
            self._ref_model = copy.deepcopy(self.train_service.model).eval().requires_grad_(False)

    def _log_probs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        v = batch.values
        with torch.no_grad():
            return compute_response_logprobs(model, v["input_ids"], v["attention_mask"], v["position_ids"],
                                             v["responses"].shape[1], self.train_service.temperature)

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        v, algo, metrics = batch.values, self._algorithm, {}
        mask = v["response_mask"]
        # Behaviour-policy logprobs: the rollout's own when it returned them (exact off-policy
        # ratios, no extra forward pass); recomputed when asked or missing.
        if algo.get("do_old_log_prob_compute", False) or "rollout_log_probs" not in v:
            v["old_log_probs"] = self._log_probs(self.train_service.model, batch)
        else:
            v["old_log_probs"] = v["rollout_log_probs"]
        scores = core_algos.scores_to_token_level(v["rewards"], mask)
        v["token_level_scores"] = scores
        if self._use_kl_in_reward:
            v["ref_log_probs"] = self._log_probs(self._ref_model, batch)
            rewards, kl_metrics = core_algos.apply_kl_penalty(scores, v["old_log_probs"], v["ref_log_probs"], mask,
                                                              self._kl_ctrl, str(algo.get("kl_penalty", "kl")))
            metrics.update({f"train/{k}": float(x) for k, x in kl_metrics.items()})
        else:
            rewards = scores
        v["token_level_rewards"] = rewards
        adv, returns = core_algos.compute_grpo_outcome_advantage(
            rewards, mask, batch.metadata["uids"], epsilon=float(algo.get("epsilon", 1e-6)),
            norm_adv_by_std=bool(algo.get("norm_adv_by_std", True)))
        v["advantages"], v["returns"] = adv, returns
        _, group_std, _ = core_algos.compute_group_stats(v["rewards"], batch.metadata["uids"])
        metrics.update({
            "train/advantages_abs_mean": float(core_algos.masked_mean(adv.abs(), mask)),
            "train/group_reward_std_mean": float(group_std.mean()),
            "train/rows_in_flat_groups": float((group_std == 0).float().mean()),
        })
        return batch, metrics

    def _loss_fn(self, batch: Batch):
        algo = self._algorithm

        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
            loss, m = core_algos.compute_policy_loss(
                mb["old_log_probs"], log_probs, mb["advantages"], mb["response_mask"],
                clip_ratio_low=float(algo.get("clip_ratio_low", 0.2)),
                clip_ratio_high=float(algo.get("clip_ratio_high", 0.2)),
                loss_agg_mode=self._loss_agg_mode, max_response_length=self._max_response_length,
                batch_num_seqs=mb["batch_num_seqs"], batch_num_tokens=mb["batch_num_tokens"])
            return loss, m
        return loss_fn

    def algorithm_state(self) -> dict[str, Any]:
        return {"kl_coef": float(self._kl_ctrl.value)}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        if "kl_coef" in state:
            self._kl_ctrl.value = float(state["kl_coef"])


class SelfHostedCrossEntropyTrainer(SelfHostedTrainer):
    """Supervised fine-tuning on trajectories' responses (e.g. from the pig_latin worker).

    Trajectories without token ids are tokenized here with the model's chat template:
    for SFT the text is the data, not a sample to be scored.
    """

    def _token_ids(self, traj: Trajectory) -> tuple[list[int], list[int]]:
        if traj.get("prompt_token_ids") is not None and traj.get("response_token_ids") is not None:
            return super()._token_ids(traj)
        tok = self.train_service.tokenizer
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

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return batch, {}

    def _loss_fn(self, batch: Batch):
        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
            nll = -log_probs
            loss = core_algos.agg_loss(nll, mb["response_mask"], "token-mean",
                                       batch_num_tokens=mb["batch_num_tokens"])
            return loss, {"nll": float(core_algos.masked_mean(nll.detach(), mb["response_mask"]))}
        return loss_fn
