"""The multi_domain data loader: batch proportions of domain_interleave_probs with whole groups,
per-domain epochs, replacements for dynamic sampling, exact resume across domains, and the
recipe checks (`nexrl validate` and the constructor say the same)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from nexrl_core.builtins.dataloaders import MultiDomainDataLoader
from nexrl_core.errors import ConfigError


def rows(name, n):
    return [{"prompt": f"{name} {i}", "answer": str(i)} for i in range(n)]


def loader(probs, sizes=None, group_size=2, batch_groups=4, seed=3, shuffle=True, is_validate=False, **extra):
    sizes = sizes or {d: 5 for d in probs}
    cfg = {"type": "multi_domain", "group_size": group_size, "batch_groups": batch_groups, "seed": seed,
           "shuffle": shuffle, "domains": {d: {"type": "inline", "rows": rows(d, n)} for d, n in sizes.items()},
           **extra}
    if probs is not None and not is_validate:
        cfg["domain_interleave_probs"] = probs
    return MultiDomainDataLoader(OmegaConf.create(cfg), is_validate=is_validate)


def take_groups(dl, groups):
    """The first task of each of the next ``groups`` groups (the loader hands out whole groups in turn)."""
    out = []
    while len(out) < groups:
        task = dl.get_next_item()
        if task["sample_index"] == 0:
            out.append(task)
    return out


# -- proportions ------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["math", "code", "judge", "if"]), st.integers(0, 9), min_size=1, max_size=4)
       .filter(lambda w: sum(w.values()) > 0), st.integers(1, 8))
def test_every_batch_is_within_one_group_of_its_share_and_the_totals_converge(weights, batch_groups):
    dl = loader(weights, group_size=1, batch_groups=batch_groups)
    total = sum(weights.values())
    batches = 60
    counts = Counter()
    for b in range(batches):
        batch = Counter(t["domain"] for t in take_groups(dl, batch_groups))
        counts.update(batch)
        for d, w in weights.items():
            # whole groups: a batch's count differs from its share by less than 2, and the running
            # total from its target by less than 1
            assert abs(batch[d] - batch_groups * w / total) < 2
            assert abs(counts[d] - (b + 1) * batch_groups * w / total) < 1
    for d, w in weights.items():
        assert counts[d] / (batches * batch_groups) == pytest.approx(w / total, abs=1 / (batches * batch_groups))
        if w == 0:
            assert counts[d] == 0


def test_integer_shares_give_every_batch_the_exact_mix():
    dl = loader({"math": 0.5, "code": 0.25, "judge": 0.25}, batch_groups=4)
    for _ in range(25):
        assert Counter(t["domain"] for t in take_groups(dl, 4)) == {"math": 2, "code": 1, "judge": 1}


def test_groups_are_whole_and_consecutive():
    dl = loader({"a": 1, "b": 3}, group_size=3)
    tasks = [dl.get_next_item() for _ in range(3 * 40)]
    for i in range(0, len(tasks), 3):
        group = tasks[i:i + 3]
        assert [t["sample_index"] for t in group] == [0, 1, 2]
        assert len({t["uid"] for t in group}) == 1 and len({t["domain"] for t in group}) == 1
        assert [t["seq"] for t in group] == list(range(i, i + 3))


def test_each_domain_cycles_through_its_own_rows_epoch_by_epoch():
    dl = loader({"small": 1, "big": 1}, sizes={"small": 3, "big": 50}, group_size=1, batch_groups=2)
    tasks = take_groups(dl, 12)
    small = [t["prompt"] for t in tasks if t["domain"] == "small"]
    assert len(small) == 6
    assert sorted(small[:3]) == sorted(small[3:]) == ["small 0", "small 1", "small 2"]  # two full epochs
    assert [t["uid"].split(":")[0] for t in tasks if t["domain"] == "small"] == ["small/0"] * 3 + ["small/1"] * 3
    big = [t["prompt"] for t in tasks if t["domain"] == "big"]
    assert len(set(big)) == 6  # no repeat before its epoch ends


def test_rows_carry_their_domain_and_it_is_their_data_source_unless_they_have_one():
    cfg = {"type": "multi_domain", "group_size": 1, "domain_interleave_probs": {"a": 1, "b": 1},
           "domains": {"a": {"type": "inline", "rows": [{"prompt": "x", "data_source": "gsm8k"}]},
                       "b": {"type": "inline", "rows": [{"prompt": "y", "domain": "ignored"}]}}}
    dl = MultiDomainDataLoader(OmegaConf.create(cfg))
    first, second = dl.get_next_item(), dl.get_next_item()
    assert (first["domain"], first["data_source"]) == ("a", "gsm8k")
    assert (second["domain"], second["data_source"]) == ("b", "b")  # the recipe's tag wins


def test_the_schedule_is_deterministic_and_follows_the_seed():
    def prompts(seed):
        return [t["prompt"] for t in take_groups(loader({"a": 1, "b": 2}, seed=seed), 30)]

    assert prompts(5) == prompts(5)
    assert prompts(5) != prompts(6)


# -- replacements (dynamic sampling) ----------------------------------------------------------------

def test_a_replacement_comes_from_the_dropped_groups_domain_and_is_not_a_scheduled_pick():
    dl = loader({"a": 1, "b": 1}, group_size=2, batch_groups=2, shuffle=False)
    first = [dl.get_next_item() for _ in range(4)]  # a, b: one batch of two groups
    assert [t["domain"] for t in first] == ["a", "a", "b", "b"]
    dropped = first[2]
    dl.add_replacement(dropped)
    group = [dl.get_next_item(), dl.get_next_item()]
    assert {t["domain"] for t in group} == {"b"} and {t["sampling_attempt"] for t in group} == {1}
    assert group[0]["uid"] != dropped["uid"]  # a fresh row, not the same prompt again
    dl.add_replacement(group[0])
    assert [dl.get_next_item()["sampling_attempt"] for _ in range(2)] == [2, 2]
    # the schedule was not advanced by the replacements: the next batch is a, b again
    following = [dl.get_next_item() for _ in range(4)]
    assert [t["domain"] for t in following] == ["a", "a", "b", "b"]
    assert not any("sampling_attempt" in t for t in following)


def test_replacements_are_served_after_the_group_in_hand():
    dl = loader({"a": 1, "b": 1}, group_size=2)
    first = dl.get_next_item()
    dl.add_replacement({"domain": "b", "uid": "x"})
    second = dl.get_next_item()
    assert second["uid"] == first["uid"] and second["sample_index"] == 1  # a group is never split
    assert dl.get_next_item()["domain"] == "b"


# -- the queue: len() and loader[i] (the data-loader contract) ------------------------------------

def test_len_and_getitem_preview_exactly_what_is_served_replacements_and_added_rows_included():
    dl = loader({"a": 2, "b": 1}, sizes={"a": 3, "b": 4}, group_size=2, batch_groups=3)
    assert len(dl) == 2 * (3 + 4)  # a training pass: as many groups as the domains have rows
    head = [dl.get_next_item() for _ in range(3)]  # mid-group: one sample pending
    dl.add_replacement(head[0])  # owed: a fresh row of head[0]'s domain, before the scheduled ones
    dl.add_item_back({"prompt": "extra", "domain": "b"})  # a new row, after the pass
    dl.add_item_front(head[1])  # a re-roll, first
    assert len(dl) == 1 + 1 + 2 * (7 - 2 + 1) + 2
    preview = [dl[i] for i in range(len(dl))]
    served = [dl.get_next_item() for _ in range(len(preview))]
    assert served == preview  # seqs, uids, domains and sampling attempts included
    assert served[2]["domain"] == head[0]["domain"] and served[2]["sampling_attempt"] == 1
    assert served[-1]["prompt"] == "extra" and len(dl) == 0
    # the next pass goes on with every domain's stream (and the interleaving) where it was
    assert len(dl) == 0 and dl.get_next_item() is not None and len(dl) == 2 * 7 - 1


# -- resume -------------------------------------------------------------------------------------------

def test_resume_continues_every_domain_exactly():
    def fresh():
        return loader({"a": 2, "b": 1, "c": 1}, sizes={"a": 4, "b": 7, "c": 2}, group_size=2, batch_groups=4)

    reference = fresh()
    served = [reference.get_next_item() for _ in range(60)]
    rng = random.Random(0)
    interrupted = fresh()
    got = []
    for _ in range(29):
        got.append(interrupted.get_next_item())
    # a dropped group and a re-rolled task are in the state too
    interrupted.add_replacement(got[-1])
    interrupted.add_item_front(got[5])
    interrupted.mark_done([t["seq"] for t in got if t["seq"] != 5 and rng.random() < 0.7])
    state = interrupted.state_dict()
    resumed = fresh()
    resumed.load_state_dict(state)
    a = [interrupted.get_next_item() for _ in range(40)]
    b = [resumed.get_next_item() for _ in range(40)]
    # outstanding tasks come back first after a resume; after them both serve the same stream
    outstanding = [t for t in b if t["seq"] < 29]
    assert [t["seq"] for t in outstanding] == sorted(t["seq"] for t in outstanding)
    rest_a = [t for t in a if t["seq"] >= 29]
    rest_b = [t for t in b if t["seq"] >= 29]
    n = min(len(rest_a), len(rest_b))
    assert n > 20 and rest_a[:n] == rest_b[:n]
    assert any(t.get("sampling_attempt") == 1 for t in rest_b)  # the owed replacement survived
    # and without interruptions the stream is the reference's
    assert [t for t in served[:29]] == got


def test_a_checkpoint_of_other_domains_is_refused():
    state = loader({"a": 1, "b": 1}).state_dict()
    other = loader({"a": 1, "c": 1})
    with pytest.raises(ConfigError, match=r"data.domains: the checkpoint's data has domains a, b, the recipe a, c"):
        other.load_state_dict(state)


# -- validation ------------------------------------------------------------------------------------

def test_validation_hands_out_every_row_of_every_domain_once_in_order():
    dl = loader(None, sizes={"a": 3, "b": 2}, group_size=2, is_validate=True, shuffle=False)
    dl.unlock_for_weight_sync()
    assert len(dl) == 10
    tasks = []
    while (t := dl.get_next_item()) is not None:
        tasks.append(t)
    assert [(t["domain"], t["prompt"]) for t in tasks if t["sample_index"] == 0] == \
        [("a", "a 0"), ("a", "a 1"), ("a", "a 2"), ("b", "b 0"), ("b", "b 1")]
    assert dl.is_finished()


# -- recipe checks --------------------------------------------------------------------------------

@pytest.mark.parametrize("section,key,expected", [
    ({"domains": {"a": {}, "b": {}}}, "data",
     "data.domain_interleave_probs: required with several domains (the share of each training batch, e.g. {a: 1, b: 1})"),
    ({"domains": {"a": {}, "b": {}}, "domain_interleave_probs": {"a": 1, "c": 1}}, "data",
     "data.domain_interleave_probs: no share for domain(s) b"),
    ({"domains": {"a": {}}, "domain_interleave_probs": {"a": -1}}, "data",
     "data.domain_interleave_probs: shares must be >= 0 (a)"),
    ({"domains": {"a": {}}, "domain_interleave_probs": {"a": 0}}, "data",
     "data.domain_interleave_probs: at least one share must be positive"),
    ({"domains": {"a": {}}, "domain_interleave_probs": {"a": 1}}, "validate.data",
     "validate.data.domain_interleave_probs: a validation pass covers every row of every domain once; delete this key"),
    ({"domains": {"a b": {}}}, "data", "data.domains.a b: a domain name is letters, digits, '_', '.' or '-'"),
    ({"domains": {"a": {"type": "multi_domain"}}}, "data", "data.domains.a.type: a domain cannot itself be multi_domain"),
])
def test_check_config_names_the_key(section, key, expected):
    assert expected in MultiDomainDataLoader.check_config(section, key)


def test_the_constructor_refuses_what_check_config_refuses():
    with pytest.raises(ConfigError, match="data.domain_interleave_probs: required with several domains"):
        loader(None, sizes={"a": 2, "b": 2})
