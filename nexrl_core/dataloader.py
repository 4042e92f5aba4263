"""Data loaders: the source of rollout tasks (training cycles, validation is one ordered pass).

Every item handed out is a *task*: a copy of one data row plus
``uid`` (the row's group id), ``sample_index`` (0..group_size-1) and ``seq`` (issue
order). A task stays *outstanding* until the trainer consumed it or it was
recorded as lost; checkpoints store the outstanding tasks so nothing is dropped
by a resume.

The queue, in the order :meth:`BaseDataLoader.get_next_item` serves it (``loader[0]`` is the
next item, ``len(loader)`` counts what is left of the current pass):

1. the *front*: tasks sent back with :meth:`~BaseDataLoader.add_item_front` (re-rollouts), in
   ``seq`` order whatever order they came back in, so a re-roll never depends on thread timing;
2. the rest of the row being handed out (its remaining samples);
3. the pass's fresh rows, each expanded into ``group_size`` tasks (replacements owed to dynamic
   sampling first, see below);
4. the *back*: items added with :meth:`~BaseDataLoader.add_item_back` / ``add_item``, in the order
   they were added; then (training) the next epoch, reshuffled.

An added item that carries a ``seq`` is a task coming back; one without is a new data row, expanded
into ``group_size`` tasks like the others.

Dynamic sampling (the trajectory pool dropping a group whose rewards are all equal) asks for a
*replacement* with :meth:`BaseDataLoader.add_replacement`: the next fresh row is drawn for it (of
the same ``domain`` where the loader has domains) and its tasks carry ``sampling_attempt``, the
number of groups that slot has dropped so far. Owed replacements are drawn in the order they were
asked for, before the pass's other fresh rows.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from typing import Any

from .config.settings import Section, read_section
from .errors import DataError, NexRLError
from .runtime.module import NexRLModule


class BaseDataLoader(NexRLModule, ABC):
    """Queue of tasks over a list of rows. Subclasses implement :meth:`load_rows`."""

    def __init__(self, config: Mapping[str, Any] | None, is_validate: bool = False):
        super().__init__()
        self._config = config = self.own_section(config, is_validate)
        self._is_validate = is_validate
        self._seed = int(config["seed"])
        self._shuffle = bool(config["shuffle"])
        self._group_size = int(config["group_size"])
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
        self._front: list[tuple[int, int, dict[str, Any]]] = []  # heap of (seq, arrival, task)
        self._arrivals = itertools.count()  # heap tie-break: a task is never compared
        self._pending: deque[dict[str, Any]] = deque()  # the current row's tasks not yet handed out
        self._back: deque[dict[str, Any]] = deque()
        self._outstanding: dict[int, dict[str, Any]] = {}
        self._owed: deque[tuple[str | None, int]] = deque()  # replacements to draw: (domain, attempt)
        self._next_seq = 0
        self._num_added = 0  # rows added through add_item_*: their uids
        self._locked = is_validate  # validation data flows only while a validation runs
        self._new_epoch()

    # -- subclass API ---------------------------------------------------------
    @abstractmethod
    def load_rows(self) -> list[dict[str, Any]]:
        """Return every data row (dicts). Raise DataError naming ``file:line`` on bad input."""

    @classmethod
    def own_section(cls, config: Mapping[str, Any] | None, is_validate: bool = False) -> Section:
        """``data`` (or ``validate.data``) as this loader reads it (``self._config``): a copy, the
        core's keys, this loader's own and those the launcher sets
        (:func:`nexrl_core.launch.preflight.dataloader_config`), defaults filled."""
        from .config.options import Option, component_options
        from .config.schema import DataSettings, ValidateDataSettings

        set_by_nexrl = {
            "shuffle": Option(not is_validate, bool, "shuffle each epoch (never for validation)"),
            "group_size": Option(1, int, "samples per row (trajectory_pool.group_size or validate.n_samples)"),
            "batch_groups": Option(1, int, "groups per training batch"),
        }
        if is_validate:  # not shuffled: a loader that draws its rows declares its own seed (data.seed trains)
            set_by_nexrl["seed"] = Option(0, int, "seed of the rows a validation loader draws")
        core = (ValidateDataSettings if is_validate else DataSettings).options()
        return read_section(config, {**(component_options(cls) or {}), **core, **set_by_nexrl},
                            "validate.data" if is_validate else "data")

    def describe(self) -> str:
        return type(self).__name__

    @classmethod
    def declared_domains(cls, section: object) -> list[str] | None:
        """The domains a recipe section of this loader gives its rows (None: not known before the
        data is read). ``nexrl validate`` checks per-domain settings against them."""
        return None

    def rows(self) -> list[dict[str, Any]]:
        """Copies of every data row, in file order."""
        return [dict(r) for r in self._rows]

    # -- seed API ---------------------------------------------------------------
    def __len__(self) -> int:
        """Items left before the current pass ends (training: in this epoch), re-queued ones included."""
        with self._lock:
            return self._remaining_locked()

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The item ``get_next_item`` would serve after ``index`` others (``0 <= index < len(self)``,
        negative indices count from the end of the pass); a fresh row's task shows the ``seq`` it
        would get if nothing is added meanwhile."""
        with self._lock:
            size = self._remaining_locked()
            if index < 0:
                index += size
            if not 0 <= index < size:
                raise IndexError(f"{self.describe()}: index {index} outside the {size} items left")
            if index < len(self._front):
                return dict(sorted(self._front)[index][2])
            index -= len(self._front)
            if index < len(self._pending):
                return dict(self._pending[index])
            index -= len(self._pending)
            fresh = self._fresh_rows_left_locked() * self._group_size
            if index < fresh:
                row, sample = divmod(index, self._group_size)
                picked, uid, attempt = self._fresh_rows_locked(row + 1, consume=False)[row]
                return self._make_task(picked, sample, self._next_seq + index, uid, attempt)
            return dict(self._back[index - fresh])

    def _health_locks(self) -> dict[str, Any]:
        return {"data loader": self._lock}

    def get_next_item(self) -> dict[str, Any] | None:
        with self._lock:
            if self._locked:
                return None
            try:
                task = self._take_locked()
            except Exception as exc:  # its queue may be half-updated: no task can be trusted after this
                self.mark_faulty(f"drawing a task failed: {type(exc).__name__}: {exc}")
                raise
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
        if not self._is_validate:  # without the lock: the monitor asks, and a hung loader must not hang it
            return False  # training data cycles for ever; total_train_steps ends the run
        with self._lock:
            return self._remaining_locked() == 0

    def can_return_item(self) -> bool:
        with self._lock:
            return self._has_item_locked()

    def reset(self) -> None:
        """Start a fresh ordered pass (validation) or epoch 0 (training)."""
        with self._lock:
            self._epoch = 0
            self._front.clear()
            self._pending.clear()
            self._back.clear()
            self._outstanding.clear()
            self._owed.clear()
            self._new_epoch()
            self._lock.notify_all()

    def add_item(self, item: dict[str, Any]) -> None:
        """Same as :meth:`add_item_back`."""
        self.add_item_back(item)

    def add_item_front(self, item: dict[str, Any]) -> None:
        """Serve ``item`` before everything not re-queued; re-queued tasks come back in ``seq`` order."""
        with self._lock:
            for task in self._as_tasks_locked(item):
                heapq.heappush(self._front, (task["seq"], next(self._arrivals), task))
            self._lock.notify_all()

    def add_item_back(self, item: dict[str, Any]) -> None:
        """Serve ``item`` after the current pass's fresh rows (training: before the next epoch)."""
        with self._lock:
            self._back.extend(self._as_tasks_locked(item))
            self._lock.notify_all()

    def add_replacement(self, item: dict[str, Any], consumed: list[int] | None = None) -> None:
        """Draw a fresh row in place of the group ``item`` belongs to (dynamic sampling dropped it):
        of the item's ``domain``, tagged ``sampling_attempt`` = the item's + 1. ``consumed``: the
        ``seq`` of the dropped group's tasks, done for good in the same step (a checkpoint never
        holds one without the other)."""
        with self._lock:
            for seq in consumed or ():
                self._outstanding.pop(seq, None)
            self._owed.append((item.get("domain"), int(item.get("sampling_attempt") or 0) + 1))
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
            front = sorted(list(self._outstanding.values()) + [t for _, _, t in self._front], key=lambda t: t["seq"])
            return {
                "epoch": self._epoch,
                "order": list(self._order),
                "cursor": self._cursor,
                "pending": [dict(t) for t in self._pending],
                "requeued": [dict(t) for t in front],
                "back": [dict(t) for t in self._back],
                "owed": [[domain, attempt] for domain, attempt in self._owed],
                "next_seq": self._next_seq,
                "num_added": self._num_added,
                **self._extra_state_locked(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._epoch = int(state["epoch"])
            self._order = [int(i) for i in state["order"]]
            self._cursor = int(state["cursor"])
            self._pending = deque(dict(t) for t in state["pending"])
            self._front = [(int(t["seq"]), next(self._arrivals), dict(t)) for t in state["requeued"]]
            heapq.heapify(self._front)
            self._back = deque(dict(t) for t in state.get("back", []))
            self._outstanding.clear()
            self._owed = deque((domain, int(attempt)) for domain, attempt in state.get("owed", []))
            self._next_seq = int(state["next_seq"])
            self._num_added = int(state.get("num_added", 0))
            self._load_extra_state_locked(state)

    # -- internals --------------------------------------------------------------
    def _new_epoch(self) -> None:
        self._order = list(range(len(self._rows)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + self._epoch).shuffle(self._order)
        self._cursor = 0

    def _has_item_locked(self) -> bool:
        # Training data cycles: at an epoch boundary the next call starts a new epoch.
        return not self._locked and (not self._is_validate or self._remaining_locked() > 0)

    def _remaining_locked(self) -> int:
        return len(self._front) + len(self._pending) + self._fresh_rows_left_locked() * self._group_size + \
            len(self._back)

    def _fresh_rows_left_locked(self) -> int:
        """Fresh rows (owed replacements included) left before the pass ends (training: the epoch)."""
        return len(self._order) - self._cursor

    def _fresh_rows_locked(self, count: int, consume: bool) -> list[tuple[int, str, int]]:
        """The next ``count`` fresh rows of the pass as (row index, uid, sampling attempt), owed
        replacements first; ``consume``: hand them out (else only look ahead)."""
        owed = list(itertools.islice(self._owed, count))
        wanted = [domain for domain, _ in owed] + [None] * (count - len(owed))
        attempts = [attempt for _, attempt in owed] + [0] * (count - len(owed))
        drawn = self._draw_rows_locked(wanted, consume)
        if consume:
            for _ in owed:
                self._owed.popleft()
        return [(index, uid, attempt) for (index, uid), attempt in zip(drawn, attempts)]

    def _draw_rows_locked(self, domains: list[str | None], consume: bool) -> list[tuple[int, str]]:
        """The next fresh rows (row index, uid), one per entry of ``domains`` (the domain a
        replacement must come from; None: the next scheduled row). Here rows have no domains:
        a replacement is the next row of the pass."""
        picked = self._order[self._cursor:self._cursor + len(domains)]
        if consume:
            self._cursor += len(picked)
        return [(index, f"{self._epoch}:{index}") for index in picked]

    def _extra_state_locked(self) -> dict[str, Any]:
        """A subclass's own resume state (merged into :meth:`state_dict`)."""
        return {}

    def _load_extra_state_locked(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`_extra_state_locked` saved."""

    def _make_task(self, index: int, sample_index: int, seq: int, uid: str, attempt: int = 0) -> dict[str, Any]:
        task = dict(self._rows[index])
        task.update(uid=uid, row_index=index, sample_index=sample_index, seq=seq)
        if attempt:
            task["sampling_attempt"] = attempt
        return task

    def _as_tasks_locked(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A task coming back (it has a ``seq``; no longer outstanding), or a new row's tasks."""
        if item.get("seq") is not None:
            self._outstanding.pop(item["seq"], None)
            return [dict(item)]
        uid = item.get("uid") or f"added:{self._num_added}"
        self._num_added += 1
        tasks = []
        for j in range(self._group_size):
            tasks.append({**item, "uid": uid, "sample_index": j, "seq": self._next_seq})
            self._next_seq += 1
        return tasks

    def _take_locked(self) -> dict[str, Any] | None:
        if self._front:
            return heapq.heappop(self._front)[2]
        if not self._pending:
            if self._fresh_rows_left_locked() <= 0:
                if self._back:
                    return self._back.popleft()
                if self._is_validate:
                    return None
                self._epoch += 1
                self._new_epoch()
            index, uid, attempt = self._fresh_rows_locked(1, consume=True)[0]
            for j in range(self._group_size):
                self._pending.append(self._make_task(index, j, self._next_seq, uid, attempt))
                self._next_seq += 1
        return self._pending.popleft()
