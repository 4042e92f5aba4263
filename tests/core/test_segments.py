"""trajectory_segments: the one reader of what a trajectory trains on (torch-free)."""

from __future__ import annotations

import pytest

from nexrl_core import trajectory_segments


def test_a_single_turn_trajectory_is_one_segment_without_a_mask():
    traj = {"prompt_token_ids": [1, 2], "response_token_ids": [3, 4], "response_logprobs": [-0.1, -0.2]}
    assert trajectory_segments(traj) == [{"prompt_token_ids": [1, 2], "response_token_ids": [3, 4],
                                          "response_logprobs": [-0.1, -0.2], "loss_mask": None}]


def test_segments_win_over_the_top_level_and_masks_become_0_1():
    first = {"prompt_token_ids": [1], "response_token_ids": [2, 3], "response_logprobs": None,
             "loss_mask": [True, False]}
    second = {"prompt_token_ids": [9], "response_token_ids": [8], "response_logprobs": [-1.0], "loss_mask": [1]}
    traj = {**first, "segments": [first, second]}
    segs = trajectory_segments(traj)
    assert [s["loss_mask"] for s in segs] == [[1, 0], [1]]
    assert segs[1]["prompt_token_ids"] == [9]


def test_a_mask_that_does_not_fit_names_the_trajectory():
    traj = {"uid": "u7", "sample_index": 2, "prompt_token_ids": [1], "response_token_ids": [2, 3], "loss_mask": [1]}
    with pytest.raises(ValueError, match=r"trajectory u7#2: loss_mask has 1 entries for 2 response tokens"):
        trajectory_segments(traj)
