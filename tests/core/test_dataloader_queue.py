"""The data loader's queue (nexrl_core/dataloader.py, the seed's BaseDataLoader): what
get_next_item serves and in which order, add_item_front / add_item_back / add_item, and
``len(loader)`` / ``loader[i]`` describing exactly what is left of the pass."""

from __future__ import annotations

import json
import random

import pytest

from nexrl_core.builtins.dataloaders import InlineDataLoader

ROWS = [{"prompt": f"row {i}"} for i in range(5)]


def make(group_size=1, shuffle=False, is_validate=False, rows=ROWS):
    dl = InlineDataLoader({"rows": rows, "group_size": group_size, "shuffle": shuffle, "seed": 3}, is_validate)
    dl.unlock_for_weight_sync()
    return dl


def drain(dl, n=None):
    out = []
    while (n is None or len(out) < n) and (item := dl.get_next_item()) is not None:
        out.append(item)
    return out


def test_len_and_getitem_describe_the_rest_of_the_pass_in_serving_order():
    dl = make(group_size=2)
    assert len(dl) == 2 * len(ROWS)
    first = drain(dl, 3)  # mid-row: one sample of row 1 is pending
    dl.add_item_front(first[0])
    dl.add_item_back({"prompt": "extra"})  # a new row: group_size tasks at the back
    assert len(dl) == 1 + 1 + 2 * 3 + 2
    preview = [dl[i] for i in range(len(dl))]
    assert dl[-1] == preview[-1] and dl[-len(dl)] == preview[0]
    for bad in (len(dl), -len(dl) - 1):
        with pytest.raises(IndexError):
            dl[bad]
    served = drain(dl, len(preview))
    assert served == preview  # the preview is exactly what is served, seqs included
    assert len(dl) == 0 and dl.can_return_item()  # training: the next epoch starts on demand
    assert len(drain(dl, 1)) == 1 and len(dl) == 2 * len(ROWS) - 1


def test_add_item_back_waits_behind_fresh_rows_then_the_epoch_turns():
    dl = make(shuffle=True)
    epoch0 = [dl[i]["prompt"] for i in range(len(dl))]
    first = drain(dl, 1)[0]
    dl.add_item_back(first)
    served = drain(dl, len(ROWS))
    assert [t["prompt"] for t in served] == epoch0[1:] + [first["prompt"]]
    assert served[-1]["seq"] == first["seq"] and served[-1]["uid"] == first["uid"]  # the same task again
    nxt = drain(dl, len(ROWS))
    assert sorted(t["prompt"] for t in nxt) == sorted(r["prompt"] for r in ROWS)
    assert {t["uid"].split(":")[0] for t in nxt} == {"1"}  # epoch 1


def test_requeued_tasks_come_back_in_issue_order_whatever_order_they_return_in():
    """What makes re-rolls independent of thread timing: the front is ordered by seq."""
    orders = set()
    for trial in range(5):
        dl = make(group_size=3, shuffle=True)
        handed = drain(dl, 7)  # rows 0, 1 and one sample of row 2
        returned = [handed[i] for i in (0, 2, 3, 5, 6)]  # the same tasks come back, in another order each time
        random.Random(trial).shuffle(returned)
        for task in returned:
            dl.add_item_front(task)
        dl.mark_done([handed[1]["seq"], handed[4]["seq"]])
        orders.add(tuple(t["seq"] for t in drain(dl, 9)))
    assert len(orders) == 1  # the same sequence, whatever the return order
    served = list(orders)[0]
    assert served == (0, 2, 3, 5, 6, 7, 8, 9, 10)  # then the pending samples of row 2, then row 3


def test_front_items_precede_the_pending_samples_of_the_current_row():
    dl = make(group_size=3)
    a, b = drain(dl, 2)  # row 0, samples 0 and 1; sample 2 is pending
    dl.add_item_front(b)
    dl.add_item_front(a)
    assert [(t["uid"], t["sample_index"]) for t in drain(dl, 4)] == \
        [("0:0", 0), ("0:0", 1), ("0:0", 2), ("0:1", 0)]


def test_a_new_row_added_is_expanded_into_a_group_with_fresh_seqs():
    dl = make(group_size=2, is_validate=True)
    served = drain(dl, 2)
    dl.add_item({"prompt": "new"})
    dl.add_item_front({"prompt": "urgent", "uid": "mine"})
    nxt = drain(dl, 2)
    assert [(t["prompt"], t["uid"], t["sample_index"]) for t in nxt] == [("urgent", "mine", 0), ("urgent", "mine", 1)]
    rest = drain(dl)
    assert [(t["prompt"], t["sample_index"]) for t in rest[-2:]] == [("new", 0), ("new", 1)]
    seqs = [t["seq"] for t in served + nxt + rest]
    assert len(set(seqs)) == len(seqs)  # every task has its own seq
    assert dl.is_finished()


def test_validation_len_counts_samples_and_reaches_zero():
    dl = make(group_size=2, is_validate=True)
    assert len(dl) == 2 * len(ROWS) and not dl.is_finished()
    items = drain(dl)
    assert len(items) == 2 * len(ROWS) and len(dl) == 0 and dl.is_finished()
    dl.add_item_back(items[3])  # a sample sent back: the pass is not over
    assert len(dl) == 1 and not dl.is_finished() and dl[0]["seq"] == items[3]["seq"]
    assert drain(dl) == [items[3]] and dl.is_finished()


def test_state_round_trip_keeps_front_pending_fresh_and_back():
    a = make(group_size=2, shuffle=True)
    handed = drain(a, 5)
    a.add_item_front(handed[1])
    a.add_item_back(handed[0])
    a.add_item({"prompt": "added"})
    a.mark_done([handed[2]["seq"]])  # handed[3], handed[4] stay outstanding: they come first on resume
    state = json.loads(json.dumps(a.state_dict()))
    b = make(group_size=2, shuffle=True)
    b.load_state_dict(state)
    assert len(b) == len(a) + 2
    resumed = drain(b, len(b) + 4)  # into the next epoch
    expected = [handed[1], handed[3], handed[4]]
    assert resumed[:3] == expected
    assert resumed[3:] == drain(a, len(resumed) - 2)[1:]  # the original serves handed[1], then the same
