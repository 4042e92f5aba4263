"""``data.type: huggingface``: rows read with the datasets library from a folder written by
``save_to_disk`` (the offline stand-in for a Hub data set), a Parquet/CSV/JSONL file, or a Hub name
(offline and not cached: one line). Columns map onto prompt/answer/data_source, the other columns
stay; the order of tasks over epochs and a resume's position are exactly the JSONL loader's."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from nexrl_core.builtins.dataloaders import FileDataLoader, HuggingFaceDataLoader  # noqa: E402
from nexrl_core.errors import DataError  # noqa: E402

ROWS = [{"question": f"{a} + {a + 1} = ?", "solution": str(2 * a + 1), "source": "add" if a % 2 else "sum",
         "level": a % 3} for a in range(10)]


def loader(path, **keys):
    return HuggingFaceDataLoader({"path": str(path), "prompt_column": "question", "answer_column": "solution", **keys})


def drain(dl, n):
    """``n`` tasks, each marked done as a trainer's batch would (an unfinished one is served again after a resume)."""
    out = []
    for _ in range(n):
        task = dl.get_next_item()
        dl.mark_done([task["seq"]])
        out.append((task["prompt"], task.get("answer")))
    return out


@pytest.fixture
def saved(tmp_path):
    """A data set as `save_to_disk` writes one: train and test splits."""
    folder = tmp_path / "gsm_like"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(folder))
    return folder


def test_a_saved_data_set_maps_its_columns_and_keeps_the_others(saved):
    rows = loader(saved, data_source_column="source").load_rows()
    assert len(rows) == 10
    assert rows[3]["prompt"] == "3 + 4 = ?" and rows[3]["answer"] == "7" and rows[3]["data_source"] == "add"
    assert rows[3]["level"] == 0 and rows[3]["solution"] == "7"  # every column stays for evaluators
    assert [r["prompt"] for r in loader(saved, split="test").load_rows()] == [r["question"] for r in ROWS[:3]]
    assert len(loader(saved, max_rows=4).load_rows()) == 4


def test_files_read_through_the_library_too(tmp_path):
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    table.to_json(str(tmp_path / "rows.jsonl"))
    for name in ("rows.parquet", "rows.csv", "rows.jsonl"):
        rows = loader(tmp_path / name).load_rows()
        assert [(r["prompt"], str(r["answer"])) for r in rows] == [(r["question"], r["solution"]) for r in ROWS], name


def test_the_task_order_and_a_resume_are_the_file_loaders(saved, tmp_path):
    """Shuffled epochs and the saved position come from the base loader: the same rows in a JSONL
    file give the same tasks in the same order, and a loader restored mid-epoch goes on identically."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": r["question"], "answer": r["solution"]}) + "\n" for r in ROWS))
    keys = {"seed": 5, "shuffle": True}
    from_hub, from_file = loader(saved, **keys), FileDataLoader({"path": str(jsonl), **keys})
    assert drain(from_hub, 25) == drain(from_file, 25)  # two and a half shuffled epochs
    state = from_hub.state_dict()
    want = drain(from_hub, 12)
    again = loader(saved, **keys)
    again.load_state_dict(state)
    assert drain(again, 12) == want


def test_bad_inputs_are_one_line_naming_the_key(saved, tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"data.answer_column: 'answer' is not a column of .* \(columns: question, "
                                        r"solution, source, level\)"):
        HuggingFaceDataLoader({"path": str(saved), "prompt_column": "question", "answer_column": "answer"}).load_rows()
    with pytest.raises(DataError, match=r"data.split: 'validation' is not a split of .* \(splits: train, test\)"):
        loader(saved, split="validation").load_rows()
    with pytest.raises(DataError, match=r"data.path: '/no/such/data' does not exist"):
        loader("/no/such/data").load_rows()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read these when imported: offline now, whatever the environment was then
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    with pytest.raises(DataError, match=r"data.path: 'nexrl-test/not-cached' could not be loaded with the datasets "
                                        r"library: .* \(offline: only a data set in the datasets cache loads"):
        loader("nexrl-test/not-cached").load_rows()
