"""Data loaders: the source of rollout tasks (training cycles, validation is one ordered pass).

Every item handed out is a *task*: a copy of one data row plus
``uid`` (the row's group id), ``sample_index`` (0..group_size-1) and ``seq`` (issue
order). A task stays *outstanding* until the trainer consumed it or it was
recorded as lost; checkpoints store the outstanding tasks so nothing is dropped
by a resume.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

from .errors import DataError, NexRLError
from .runtime.module import NexRLModule


class BaseDataLoader(NexRLModule, ABC):
    """Queue of tasks over a list of rows. Subclasses implement :meth:`load_rows`."""

    def __init__(self, config: Any, is_validate: bool = False):
        super().__init__()
        self._config = config
        self._is_validate = is_validate
        self._seed = int(config.get("seed", 0) or 0)
        self._shuffle = bool(config.get("shuffle", not is_validate))
        self._group_size = int(config.get("group_size", 1) or 1)
        self._lock = threading.Condition()
        try:
            self._rows: list[dict[str, Any]] = self.load_rows()
        except NexRLError:
            raise
        except Exception as exc:  # a loader's bug or a format it did not expect: one line, no traceback
            raise DataError(f"{'validate.data' if is_validate else 'data'}: {type(self).__name__} could not read "
                            f"{self.describe()}: {type(exc).__name__}: {exc}") from None
        if not self._rows:
            raise DataError(f"{self.describe()}: the data has no rows")
        self._epoch = 0
        self._order: list[int] = []
        self._cursor = 0  # next row in self._order
        self._pending: deque[dict[str, Any]] = deque()  # expanded tasks not yet handed out
        self._requeued: deque[dict[str, Any]] = deque()
        self._outstanding: dict[int, dict[str, Any]] = {}
        self._next_seq = 0
        self._locked = is_validate  # validation data flows only while a validation runs
        self._new_epoch()

    # -- subclass API ---------------------------------------------------------
    @abstractmethod
    def load_rows(self) -> list[dict[str, Any]]:
        """Return every data row (dicts). Raise DataError naming ``file:line`` on bad input."""

    def describe(self) -> str:
        return type(self).__name__

    # -- seed API ---------------------------------------------------------------
    def __len__(self) -> int:
        """Tasks left before the current pass ends (training: in this epoch)."""
        with self._lock:
            return self._remaining_locked()

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self._rows[index])

    def get_next_item(self) -> dict[str, Any] | None:
        with self._lock:
            if self._locked:
                return None
            task = self._take_locked()
            if task is not None:
                self._outstanding[task["seq"]] = task
            return None if task is None else dict(task)

    def get_next_items(self, count: int) -> list[dict[str, Any]]:
        """Up to ``count`` items (fewer when the loader runs dry): one call for several tasks."""
        items = []
        for _ in range(count):
            item = self.get_next_item()
            if item is None:
                break
            items.append(item)
        return items

    def is_finished(self) -> bool:
        with self._lock:
            if self._is_validate:
                return self._remaining_locked() == 0
            return False  # training data cycles for ever; total_train_steps ends the run

    def can_return_item(self) -> bool:
        with self._lock:
            return self._has_item_locked()

    def reset(self) -> None:
        """Start a fresh ordered pass (validation) or epoch 0 (training)."""
        with self._lock:
            self._epoch = 0
            self._requeued.clear()
            self._pending.clear()
            self._outstanding.clear()
            self._new_epoch()
            self._lock.notify_all()

    def add_item(self, item: dict[str, Any]) -> None:
        self.add_item_back(item)

    def add_item_front(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._requeued.appendleft(dict(item))
            self._outstanding.pop(item.get("seq"), None)
            self._lock.notify_all()

    def add_item_back(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._requeued.append(dict(item))
            self._outstanding.pop(item.get("seq"), None)
            self._lock.notify_all()

    def lock_for_weight_sync(self) -> None:
        with self._lock:
            self._locked = True

    def unlock_for_weight_sync(self) -> None:
        with self._lock:
            self._locked = False
            self._lock.notify_all()

    def wait_for_item(self, timeout: float) -> bool:
        """Wait (no polling) until an item can be returned; False on timeout."""
        with self._lock:
            return self._lock.wait_for(self._has_item_locked, timeout)

    # -- accounting -------------------------------------------------------------
    def mark_done(self, seqs: list[int]) -> None:
        """Tasks consumed for good (trained on, or recorded as lost)."""
        with self._lock:
            for seq in seqs:
                self._outstanding.pop(seq, None)

    def outstanding(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(t) for _, t in sorted(self._outstanding.items())]

    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def group_size(self) -> int:
        return self._group_size

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; outstanding tasks come first again on load."""
        with self._lock:
            queued = sorted(list(self._outstanding.values()) + list(self._requeued), key=lambda t: t["seq"])
            return {
                "epoch": self._epoch,
                "order": list(self._order),
                "cursor": self._cursor,
                "pending": [dict(t) for t in self._pending],
                "requeued": [dict(t) for t in queued],
                "next_seq": self._next_seq,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._epoch = int(state["epoch"])
            self._order = [int(i) for i in state["order"]]
            self._cursor = int(state["cursor"])
            self._pending = deque(dict(t) for t in state["pending"])
            self._requeued = deque(dict(t) for t in state["requeued"])
            self._outstanding.clear()
            self._next_seq = int(state["next_seq"])

    # -- internals --------------------------------------------------------------
    def _new_epoch(self) -> None:
        self._order = list(range(len(self._rows)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + self._epoch).shuffle(self._order)
        self._cursor = 0

    def _has_item_locked(self) -> bool:
        # Training data cycles: at an epoch boundary the next call starts a new epoch.
        return not self._locked and (self._remaining_locked() > 0 or not self._is_validate)

    def _remaining_locked(self) -> int:
        return len(self._requeued) + len(self._pending) + (len(self._order) - self._cursor) * self._group_size

    def _take_locked(self) -> dict[str, Any] | None:
        if self._requeued:
            return self._requeued.popleft()
        if not self._pending:
            if self._cursor >= len(self._order):
                if self._is_validate:
                    return None
                self._epoch += 1
                self._new_epoch()
            index = self._order[self._cursor]
            self._cursor += 1
            row = self._rows[index]
            for j in range(self._group_size):
                task = dict(row)
                task["uid"] = f"{self._epoch}:{index}"
                task["row_index"] = index
                task["sample_index"] = j
                task["seq"] = self._next_seq
                self._next_seq += 1
                self._pending.append(task)
        return self._pending.popleft()
