"""Built-in data loaders: JSONL/Parquet files, rows inline in the recipe, generated arithmetic."""

from __future__ import annotations

import json
import os
import random
from typing import Any

from ..dataloader import BaseDataLoader
from ..errors import ConfigError, DataError
from ..markers import hookimpl
from ..options import REQUIRED, Option, option_defaults

_PATHS = (str, list[str])


class FileDataLoader(BaseDataLoader):
    """Rows from JSONL or Parquet files (``path``: one path or a list)."""

    OPTIONS = {
        "path": Option(None, _PATHS, "JSONL or Parquet file, or a list of them", path=True),
        "dataset_paths": Option(None, _PATHS, "the seed's name for path", path=True),
        "prompt_key": Option("prompt", str, "row field that holds the prompt"),
    }

    @classmethod
    def check_config(cls, section: Any, key: str) -> list[str]:
        if not section.get("path") and not section.get("dataset_paths"):
            return [f"{key}.path: required (a JSONL or Parquet file, or a list of them)"]
        return []

    def __init__(self, config: Any, is_validate: bool = False):
        paths = config.get("path") or config.get("dataset_paths")
        if not paths:
            raise ConfigError(f"{_section(is_validate)}.path: required (a JSONL or Parquet file, or a list of them)")
        self._paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        self._prompt_key = str(config.get("prompt_key", "prompt"))
        super().__init__(config, is_validate)

    def describe(self) -> str:
        return ", ".join(self._paths)

    def load_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for path in self._paths:
            rows.extend(read_rows(path, self._prompt_key))
        return rows


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


class InlineDataLoader(BaseDataLoader):
    """Rows written in the recipe itself (``rows: [{prompt: ..., answer: ...}, ...]``)."""

    OPTIONS = {"rows": Option(REQUIRED, list[dict], "the rows, e.g. [{prompt: '1 + 2', answer: '3'}]")}

    def load_rows(self) -> list[dict[str, Any]]:
        rows = self._config.get("rows") or []
        return [dict(r) for r in rows]


class ArithmeticDataLoader(BaseDataLoader):
    """``a + b`` questions with exact integer answers, generated from a seed.

    ``split: train`` and ``split: validation`` draw from disjoint halves of the
    operand space (by a hash of the pair), so validation never repeats a training
    question.
    """

    OPTIONS = {
        "num_rows": Option(256, int, "questions to generate", ge=1),
        "min_value": Option(0, int, "smallest operand"),
        "max_value": Option(99, int, "largest operand"),
        "split": Option("train", str, "which half of the operand pairs", choices=("train", "validation")),
        "template": Option("What is {a} + {b}? Reply with only the number.", str, "prompt, with {a} and {b}"),
        "data_source": Option("arithmetic", str, "data_source of every row"),
        "seed": Option(None, int, "seed of the questions drawn (training data: data.seed)"),
    }
    CONFIG_KEYS = option_defaults(OPTIONS)  # deprecated view, for plugins that extend it

    @classmethod
    def check_config(cls, section: Any, key: str) -> list[str]:
        lo = section.get("min_value", cls.OPTIONS["min_value"].default)
        hi = section.get("max_value", cls.OPTIONS["max_value"].default)
        return [f"{key}.max_value: {hi} is below min_value {lo}"] if hi < lo else []

    def load_rows(self) -> list[dict[str, Any]]:
        cfg = self._config
        lo, hi = int(cfg.get("min_value", 0)), int(cfg.get("max_value", 99))
        n = int(cfg.get("num_rows", 256))
        split = str(cfg.get("split", "train"))
        if split not in ("train", "validation"):
            raise ConfigError(f"{_section(self._is_validate)}.split: '{split}' is not one of train, validation")
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                 if ((a * 7919 + b * 104729) % 5 == 0) == (split == "validation")]
        if n > len(pairs):
            raise ConfigError(f"{_section(self._is_validate)}.num_rows: {n} rows requested but only {len(pairs)} distinct "
                              f"{split} questions exist in [{lo}, {hi}]")
        random.Random(int(cfg.get("seed", 0) or 0) + (1 if split == "validation" else 0)).shuffle(pairs)
        template = str(cfg.get("template", self.OPTIONS["template"].default))
        source = str(cfg.get("data_source", "arithmetic"))
        return [{"prompt": template.format(a=a, b=b), "answer": a + b, "data_source": source}
                for a, b in pairs[:n]]


@hookimpl
def nexrl_dataloaders():
    return {"file": FileDataLoader, "inline": InlineDataLoader, "arithmetic": ArithmeticDataLoader}
