"""Built-in data loaders: JSONL/Parquet files, rows inline in the recipe, generated arithmetic, and
several of those as the domains of one multi-domain data set."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, ClassVar, Literal

from omegaconf import OmegaConf

from ..config.options import Option
from ..config.settings import PlainData, Settings, setting
from ..dataloader import BaseDataLoader
from ..errors import ConfigError, DataError
from ..markers import hookimpl


@dataclass(frozen=True, kw_only=True)
class FileDataSettings(Settings):
    """The ``file`` loader's keys."""

    path: str | list[str] | None = setting(None, "JSONL or Parquet file, or a list of them", path=True)
    dataset_paths: str | list[str] | None = setting(None, "the seed's name for path", path=True)
    prompt_key: str = setting("prompt", "row field that holds the prompt")

    def paths(self) -> tuple[str, list[str]]:
        """The key that names the files (``path``, else the seed's ``dataset_paths``) and the files."""
        name = "path" if self.path else "dataset_paths"
        paths = self.path or self.dataset_paths or []
        return name, [paths] if isinstance(paths, str) else list(paths)


class FileDataLoader(BaseDataLoader):
    """Rows from JSONL or Parquet files (``path``: one path or a list)."""

    SETTINGS: ClassVar[type[Settings]] = FileDataSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        """A missing path, or a file that does not exist (with the nearest file of its folder): said
        before a run creates anything, as ``nexrl validate`` says it."""
        name, paths = FileDataSettings.own(section, key).paths()
        if not paths:
            return [f"{key}.path: required (a JSONL or Parquet file, or a list of them)"]
        return [f"{key}.{name}: '{p}': data file not found{_near_miss(p)}" for p in paths
                if "${" not in p and not os.path.exists(p)]

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        bound = self.own_section(config, is_validate)
        self.settings = FileDataSettings.own(bound, _section(is_validate))
        self._paths = self.settings.paths()[1]
        if not self._paths:
            raise ConfigError(f"{_section(is_validate)}.path: required (a JSONL or Parquet file, or a list of them)")
        super().__init__(bound, is_validate)

    def describe(self) -> str:
        return ", ".join(self._paths)

    def load_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for path in self._paths:
            rows.extend(read_rows(path, self.settings.prompt_key))
        return rows


@dataclass(frozen=True, kw_only=True)
class HuggingFaceDataSettings(Settings):
    """The ``huggingface`` loader's keys."""

    path: str = setting(help="a Hub data set name, a save_to_disk folder, or a .parquet/.json/.jsonl/.csv file",
                        path=True)
    name: str | None = setting(None, "the data set's configuration (e.g. 'main' for openai/gsm8k)")
    split: str = setting("train", "which split to read (a file has one: train)")
    prompt_column: str = setting("prompt", "column that holds the prompt (text, or a list of chat messages)")
    answer_column: str | None = setting(None, "column copied into the row's answer (what exact_match, numeric_answer "
                                              "and math_rule compare with)")
    data_source_column: str | None = setting(None, "column copied into the row's data_source (validation metrics "
                                                   "per source: val/<data_source>_<score>)")
    streaming: bool = setting(False, "read a Hub data set as a stream, stopping after max_rows (a part of a set "
                                     "too large to download)", needs=".max_rows")
    max_rows: int | None = setting(None, "read at most this many rows", ge=1)


class HuggingFaceDataLoader(BaseDataLoader):
    """Rows of a data set read with the Hugging Face ``datasets`` library (``data.type: huggingface``):
    a Hub name (``openai/gsm8k``, from the datasets cache; fetched when online), a folder written by
    ``save_to_disk``, or a Parquet, JSON/JSONL or CSV file. Its columns map onto a row's ``prompt``,
    ``answer`` and ``data_source``; every other column stays in the row (an evaluator or a reward
    function reads it). Shuffling and the resume position are the base loader's, as for files."""

    SETTINGS: ClassVar[type[Settings]] = HuggingFaceDataSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        try:
            import datasets  # noqa: F401
        except ImportError:
            return [f"{key}.type: huggingface needs the datasets library: pip install 'nexrl-core[datasets]'"]
        return []

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        self._key = _section(is_validate)
        bound = self.own_section(config, is_validate)
        self.settings = settings = HuggingFaceDataSettings.own(bound, self._key)
        self._path, self._split = settings.path, settings.split
        self._columns = {"prompt": settings.prompt_column, "answer": settings.answer_column,
                         "data_source": settings.data_source_column}
        super().__init__(bound, is_validate)

    def describe(self) -> str:
        return f"{self._path} ({self._split})"

    def load_rows(self) -> list[dict[str, Any]]:
        table = self._open()
        rows: list[dict[str, Any]] = []
        for i, example in enumerate(table):
            if self.settings.max_rows is not None and i >= self.settings.max_rows:
                break
            rows.append(self._row(dict(example), i))
        if not rows:
            raise DataError(f"{self._key}.path: {self._path} ({self._split}) holds no rows")
        return rows

    def _open(self) -> Any:
        import datasets

        path, where = self._path, f"{self._key}.path: '{self._path}'"
        try:
            if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                           for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
                loaded = datasets.load_from_disk(path)
                if isinstance(loaded, datasets.DatasetDict):
                    if self._split not in loaded:
                        raise DataError(f"{self._key}.split: '{self._split}' is not a split of {path} (splits: "
                                        f"{', '.join(loaded)})")
                    loaded = loaded[self._split]
                return loaded
            builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}.get(
                os.path.splitext(path)[1].lower())
            if os.path.isfile(path):
                if builder is None:
                    raise DataError(f"{where} is a file the datasets library cannot read by its extension "
                                    f"(.parquet, .json, .jsonl, .csv)")
                return datasets.load_dataset(builder, data_files=path, split="train")
            if os.path.isabs(path) or path.startswith("."):
                raise DataError(f"{where} does not exist")
            return datasets.load_dataset(path, self.settings.name, split=self._split, streaming=self.settings.streaming)
        except DataError:
            raise
        except Exception as exc:  # the library's own errors: offline and not cached, an unknown split...
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
            hint = (" (offline: only a data set in the datasets cache loads; fetch it once online, or give a "
                    "save_to_disk folder or a data file)") if offline else ""
            raise DataError(f"{where} could not be loaded with the datasets library: {type(exc).__name__}: "
                            f"{text}{hint}") from None

    def _row(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        columns = list(row)
        for field_name, column in self._columns.items():
            if column is None:
                continue
            if column not in columns:
                raise DataError(f"{self._key}.{field_name}_column: '{column}' is not a column of {self._path} "
                                f"(columns: {', '.join(map(str, columns))})")
            row[field_name] = row[column]
        if row.get("prompt") in (None, "", []):
            raise DataError(f"{self._path}: row {index + 1} has no prompt in column '{self._columns['prompt']}'")
        return row


def _near_miss(path: str) -> str:
    """``; did you mean 'x'?`` naming the file of ``path``'s folder whose name is nearest, or ''."""
    import difflib

    folder = os.path.dirname(path) or "."
    try:
        names = [n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))]
    except OSError:
        return ""
    near = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.75)
    return f"; did you mean '{os.path.join(os.path.dirname(path), near[0])}'?" if near else ""


def _section(is_validate: bool) -> str:
    return "validate.data" if is_validate else "data"


def read_rows(path: str, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Read a JSONL or Parquet file; every row must be an object holding ``prompt_key``."""
    if not os.path.exists(path):
        raise DataError(f"{path}: data file not found")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, not a data file (name the .jsonl or .parquet files in it)")
    if path.endswith(".parquet"):
        rows = _read_parquet(path)
        locate = lambda i: f"{path}: row {i + 1}"  # noqa: E731
    else:
        rows, lines = _read_jsonl(path)
        locate = lambda i: f"{path}:{lines[i]}"  # noqa: E731
    if not rows:
        raise DataError(f"{path}: the file holds no rows")
    for i, row in enumerate(rows):
        if prompt_key not in row or row[prompt_key] in (None, ""):
            raise DataError(f"{locate(i)}: the row has no '{prompt_key}' field "
                            f"(set data.prompt_key if the prompt lives under another name)")
    return rows


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    rows, lines = [], []
    try:
        with open(path, "rb") as f:
            raw_lines = f.readlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    for lineno, raw in enumerate(raw_lines, 1):
        if b"\0" in raw:
            raise DataError(f"{path}:{lineno}: binary data (a NUL byte), not JSON lines")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                            f"{exc.start + 1}); save the file as UTF-8") from None
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(lineno)
    return rows, lines


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None


@dataclass(frozen=True, kw_only=True)
class InlineDataSettings(Settings):
    """The ``inline`` loader's keys."""

    rows: list[dict[str, PlainData]] = setting(help="the rows, e.g. [{prompt: '1 + 2', answer: '3'}]")


class InlineDataLoader(BaseDataLoader):
    """Rows written in the recipe itself (``rows: [{prompt: ..., answer: ...}, ...]``)."""

    SETTINGS: ClassVar[type[Settings]] = InlineDataSettings

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        bound = self.own_section(config, is_validate)
        self.settings = InlineDataSettings.own(bound, _section(is_validate))
        super().__init__(bound, is_validate)

    def load_rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.settings.rows]


@dataclass(frozen=True, kw_only=True)
class ArithmeticDataSettings(Settings):
    """The ``arithmetic`` loader's keys."""

    num_rows: int = setting(256, "questions to generate", ge=1)
    min_value: int = setting(0, "smallest operand")
    max_value: int = setting(99, "largest operand")
    split: Literal["train", "validation"] = setting("train", "which half of the operand pairs")
    template: str = setting("What is {a} + {b}? Reply with only the number.", "prompt, with {a} and {b}")
    data_source: str = setting("arithmetic", "data_source of every row")
    seed: int = setting(0, "seed of the questions drawn (training data: data.seed)")


class ArithmeticDataLoader(BaseDataLoader):
    """``a + b`` questions with exact integer answers, generated from a seed.

    ``split: train`` and ``split: validation`` draw from disjoint halves of the
    operand space (by a hash of the pair), so validation never repeats a training
    question.
    """

    SETTINGS: ClassVar[type[Settings]] = ArithmeticDataSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        settings = ArithmeticDataSettings.own(section, key)
        lo, hi = settings.min_value, settings.max_value
        return [f"{key}.max_value: {hi} is below min_value {lo}"] if hi < lo else []

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        bound = self.own_section(config, is_validate)
        self.settings = ArithmeticDataSettings.own(bound, _section(is_validate))
        super().__init__(bound, is_validate)

    def load_rows(self) -> list[dict[str, Any]]:
        settings = self.settings
        lo, hi, n, split = settings.min_value, settings.max_value, settings.num_rows, settings.split
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                 if ((a * 7919 + b * 104729) % 5 == 0) == (split == "validation")]
        if n > len(pairs):
            raise ConfigError(f"{_section(self._is_validate)}.num_rows: {n} rows requested but only {len(pairs)} distinct "
                              f"{split} questions exist in [{lo}, {hi}]")
        random.Random(settings.seed + (1 if split == "validation" else 0)).shuffle(pairs)
        return [{"prompt": settings.template.format(a=a, b=b), "answer": a + b, "data_source": settings.data_source}
                for a, b in pairs[:n]]


_DOMAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")



@dataclass(frozen=True, kw_only=True)
class DomainData(Settings):
    """The core's keys of one domain's data loader mapping (the loader adds its own)."""

    type: str = setting("file", "registered data loader of this domain's rows")
    seed: int | None = setting(None, "seed of this domain's shuffling (default: data.seed)")
    shuffle: bool | None = setting(None, "shuffle this domain's rows each epoch (default: data.shuffle)")


@dataclass(frozen=True, kw_only=True)
class MultiDomainSettings(Settings):
    """The ``multi_domain`` loader's keys."""

    domains: dict[str, dict[str, PlainData]] = setting(
        help="the domains, by name: {<domain>: {type: <data loader>, <its keys>}}",
        values=Option(options=DomainData.options(), component="dataloader",
                      help="one domain's data: a data loader mapping"))
    domain_interleave_probs: dict[str, float] | None = setting(None, "training: the share of groups each domain "
                                                                     "gets ({<domain>: weight}; normalised to sum 1)")


@dataclass
class _DomainStream:
    """One domain's pass over its rows: its own epochs and shuffles."""

    rows: list[int]  # row indices (into the loader's rows) of this domain
    seed: int = 0
    shuffle: bool = True
    order: list[int] = field(default_factory=list)
    cursor: int = 0
    epoch: int = -1


class MultiDomainDataLoader(BaseDataLoader):
    """Several data sets, each a *domain* (ROLL's multi-domain RLVR): every row gets ``domain``
    (and ``data_source`` = the domain when it has none), so each domain can have its own evaluator
    (``rollout_worker.domain_evaluators``), reward processing
    (``algorithm.reward_processing.domains``) and metrics (``train/<domain>/...``,
    ``val/<domain>_...``).

    Training draws whole rows (GRPO groups) from the domains in the proportions of
    ``domain_interleave_probs``, batch by batch: for the ``b``-th batch of ``G`` groups
    (``trajectory_pool.batch_size / group_size``), each pick goes to the domain furthest below its
    target ``(b + 1) * G * p_d`` of groups issued so far. So every batch holds whole groups in
    the given proportions (exactly when each ``G * p_d`` is an integer; otherwise the counts so far
    stay within one group of the target), and the choice is deterministic. Each domain runs
    through its own rows epoch by epoch, reshuffled with its own seed. A replacement asked for by
    dynamic sampling comes from the dropped group's domain and does not count as a pick. A training
    pass (what ``len()`` counts and ``add_item_back`` items wait for) is as many scheduled groups
    as the domains have rows together. Validation hands every row of every domain out once, domain by domain.
    """

    SETTINGS: ClassVar[type[Settings]] = MultiDomainSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        settings, problems = MultiDomainSettings.parse(section, key, own=True)
        return problems if settings is None else _domain_problems(settings, key)

    @classmethod
    def declared_domains(cls, section: object) -> list[str] | None:
        domains = section.get("domains") if isinstance(section, Mapping) else None
        return [str(d) for d in domains] if isinstance(domains, Mapping) else None

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        self._key = _section(is_validate)
        bound = self.own_section(config, is_validate)
        self.settings = settings = MultiDomainSettings.own(bound, self._key)
        problems = _domain_problems(settings, self._key)
        if problems:
            raise ConfigError("; ".join(problems))
        self._domain_configs = {str(d): dict(c) for d, c in settings.domains.items()}
        self._domains = list(self._domain_configs)
        probs = settings.domain_interleave_probs or {d: 1.0 for d in self._domains}
        weights = {d: Fraction(str(float(probs[d]))) for d in self._domains}
        total = sum(weights.values())
        self._probs = {d: w / total for d, w in weights.items()}
        self._batch_groups = max(1, int(bound["batch_groups"]))  # set by nexrl (BaseDataLoader.own_section)
        self._streams: dict[str, _DomainStream] = {}
        self._scheduled = {d: 0 for d in self._domains}
        self._pass_start = 0
        super().__init__(bound, is_validate)

    def describe(self) -> str:
        return f"{self._key} (domains {', '.join(self._domains)})"

    def load_rows(self) -> list[dict[str, Any]]:
        from ..plugins import active_plugin_manager

        pm = active_plugin_manager()
        rows: list[dict[str, Any]] = []
        self._domain_rows: dict[str, list[int]] = {}
        for name, section in self._domain_configs.items():
            key = f"{self._key}.domains.{name}"
            cls = pm.resolve("dataloader", DomainData.own(section, key).type, f"{key}.type")
            child = {**section, "group_size": self._group_size, **self._domain_order(name)}
            try:
                loaded = cls(OmegaConf.create(child), is_validate=self._is_validate).rows()
            except DataError as exc:
                raise DataError(f"{key}: {exc}") from None
            start = len(rows)
            for row in loaded:
                row["domain"] = name
                row.setdefault("data_source", name)
                rows.append(row)
            self._domain_rows[name] = list(range(start, len(rows)))
        return rows

    # -- training: per-domain streams and the interleaving schedule -------------------------------
    def _domain_order(self, domain: str) -> dict[str, Any]:
        """A domain's seed and shuffle: its own keys, else the data section's."""
        own = DomainData.own(self._domain_configs[domain], f"{self._key}.domains.{domain}")
        return {"seed": self._seed if own.seed is None else own.seed,
                "shuffle": self._shuffle if own.shuffle is None else own.shuffle}

    def _new_epoch(self) -> None:
        super()._new_epoch()  # validation: one ordered pass over all rows, domain by domain
        if self._is_validate:
            return
        if self._epoch == 0:  # the start (or a reset): each domain's stream from its beginning
            self._streams = {d: _DomainStream(self._domain_rows[d], **self._domain_order(d)) for d in self._domains}
            self._scheduled = {d: 0 for d in self._domains}
        # A training pass is as many scheduled groups as the domains have rows together; each
        # domain's stream runs on across passes (its own epochs), so the proportions hold throughout.
        self._pass_start = sum(self._scheduled.values())

    def _draw(self, streams: dict[str, _DomainStream], scheduled: dict[str, int], domain: str | None) -> tuple[int, str]:
        """The next row of ``domain`` (a replacement), else of the scheduled pick; advances
        ``streams`` and ``scheduled`` (the loader's own, or copies to look ahead)."""
        if domain not in streams:
            domain = self._pick_domain(scheduled)
            scheduled[domain] += 1
        stream = streams[domain]
        if stream.cursor >= len(stream.order):
            stream.epoch += 1
            stream.order = list(stream.rows)
            if stream.shuffle:
                random.Random(f"{stream.seed}|{domain}|{stream.epoch}").shuffle(stream.order)
            stream.cursor = 0
        index = stream.order[stream.cursor]
        stream.cursor += 1
        return index, f"{domain}/{stream.epoch}:{index}"

    def next_domain(self) -> str:
        """The domain the next scheduled group comes from (see the class docstring)."""
        with self._lock:
            return self._pick_domain(self._scheduled)

    def _pick_domain(self, scheduled: dict[str, int]) -> str:
        issued = sum(scheduled.values())
        end_of_batch = (issued // self._batch_groups + 1) * self._batch_groups
        deficits = {d: end_of_batch * p - scheduled[d] for d, p in self._probs.items() if p > 0}
        return max(deficits, key=lambda d: (deficits[d], -self._domains.index(d)))

    def _fresh_rows_left_locked(self) -> int:
        if self._is_validate:
            return super()._fresh_rows_left_locked()
        return len(self._rows) - (sum(self._scheduled.values()) - self._pass_start) + len(self._owed)

    def _draw_rows_locked(self, domains: list[str | None], consume: bool) -> list[tuple[int, str]]:
        if self._is_validate:
            return super()._draw_rows_locked(domains, consume)
        streams = self._streams if consume else {d: replace(s, order=list(s.order)) for d, s in self._streams.items()}
        scheduled = self._scheduled if consume else dict(self._scheduled)
        return [self._draw(streams, scheduled, domain) for domain in domains]

    def _extra_state_locked(self) -> dict[str, Any]:
        if self._is_validate:
            return {}
        return {"domains": {d: {"epoch": s.epoch, "order": list(s.order), "cursor": s.cursor}
                            for d, s in self._streams.items()},
                "scheduled": dict(self._scheduled), "pass_start": self._pass_start}

    def _load_extra_state_locked(self, state: dict[str, Any]) -> None:
        if self._is_validate:
            return
        saved = state.get("domains")
        if not isinstance(saved, dict) or sorted(saved) != sorted(self._domains):
            have = ", ".join(sorted(saved)) if isinstance(saved, dict) else "none"
            raise ConfigError(f"{self._key}.domains: the checkpoint's data has domains {have}, the recipe "
                              f"{', '.join(sorted(self._domains))}; resume with the recipe that wrote it")
        for d, s in saved.items():
            stream = self._streams[d]
            stream.epoch, stream.order, stream.cursor = int(s["epoch"]), [int(i) for i in s["order"]], int(s["cursor"])
        self._scheduled = {d: int(state["scheduled"].get(d, 0)) for d in self._domains}
        self._pass_start = int(state.get("pass_start", 0))


def _domain_problems(settings: MultiDomainSettings, key: str) -> list[str]:
    domains, probs = settings.domains, settings.domain_interleave_probs
    problems = [f"{key}.domains.{name}: a domain name is letters, digits, '_', '.' or '-'"
                for name in domains if not _DOMAIN_NAME.fullmatch(str(name))]
    if not domains:
        problems.append(f"{key}.domains: name at least one domain")
    problems += [f"{key}.domains.{name}.type: a domain cannot itself be multi_domain"
                 for name, sub in domains.items() if isinstance(sub, dict) and sub.get("type") == "multi_domain"]
    if key.startswith("validate"):
        if probs is not None:
            problems.append(f"{key}.domain_interleave_probs: a validation pass covers every row of every domain "
                            f"once; delete this key")
        return problems
    if probs is None:
        if len(domains) > 1:
            problems.append(f"{key}.domain_interleave_probs: required with several domains (the share of each "
                            f"training batch, e.g. {{{', '.join(f'{d}: 1' for d in domains)}}})")
        return problems
    missing = [d for d in domains if d not in probs]
    unknown = [d for d in probs if d not in domains]
    if missing:
        problems.append(f"{key}.domain_interleave_probs: no share for domain(s) {', '.join(missing)}")
    if unknown:
        problems.append(f"{key}.domain_interleave_probs: {', '.join(map(str, unknown))} "
                        f"{'is not a domain' if len(unknown) == 1 else 'are not domains'} "
                        f"(domains: {', '.join(domains)})")
    negative = [d for d, p in probs.items() if p < 0]
    if negative:
        problems.append(f"{key}.domain_interleave_probs: shares must be >= 0 ({', '.join(negative)})")
    elif not missing and not unknown and sum(probs.values()) <= 0:
        problems.append(f"{key}.domain_interleave_probs: at least one share must be positive")
    return problems


@hookimpl
def nexrl_dataloaders():
    return {"file": FileDataLoader, "inline": InlineDataLoader, "arithmetic": ArithmeticDataLoader,
            "multi_domain": MultiDomainDataLoader, "huggingface": HuggingFaceDataLoader}
