"""The loop-placed and V-shaped schedules across processes (issue 36): 2 gloo ranks on 127.0.0.1, hard timeouts."""
import pytest
import torch.distributed as dist

from tests.distributed.launch import launch, ok

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


def test_the_new_schedules_are_transparent_across_processes_and_on_a_mesh() -> None:
    # looped_bfs, interleaved_zero_bubble, zbv and dualpipev over 4 stages on 2 ranks (the V: rank 0 holds stages
    # 0 and 3, rank 1 stages 1 and 2; the loop: 0 and 2, 1 and 3), a skip model under every checkpoint mode and a
    # tied embedding and head; then zbv on a 1 x 2 mesh.
    problems = ok(launch("tests.distributed.ranks_schedules:new_schedules", 2, timeout=300))
    assert problems == [[], []], problems


def test_a_v_balance_that_does_not_fit_the_ranks_is_refused_on_every_rank() -> None:
    for message in ok(launch("tests.distributed.ranks_schedules:v_balance_that_does_not_fit", 2)):
        assert "zbv places 2 stages per rank in a V (rank r holds stages r and 3 - r), so balance needs " \
               "2 * 2 = 4 entries for 2 ranks; got 2" in message, message


def test_auto_chooses_alike_on_every_rank_and_stays_transparent() -> None:
    # Each rank measures its own stages on the first step; the costs are exchanged, so every rank simulates the
    # same candidates from the same costs and runs the same choice (a rank that chose otherwise would wait for
    # messages that never come).
    reports = ok(launch("tests.distributed.ranks_schedules:auto_choice", 2, timeout=180))
    assert [r["problems"] for r in reports] == [[], []]
    assert reports[0]["costs"] == reports[1]["costs"]
    assert {len(c) for c in reports[0]["costs"]} == {16, 8}, "F, B, I and W of every stage, from both ranks"
    assert reports[0]["choices"] == reports[1]["choices"]
    assert reports[0]["choices"][0] in ("zbv", "dualpipev")
    assert reports[0]["choices"][1] in ("1f1b", "zero_bubble", "gpipe")
    # A pipeline's first step is its messages' first crossing: each rank expects no layout yet, so every message
    # it takes (at least 4 activations or gradients, and the skips') waits for a relayout, timed and left out of
    # the overhead the choice charges each action. Later steps wait for none.
    for report in reports:
        counts = report["relayouts_per_step"]
        v_first, v_later, one_first, one_later = counts[0], counts[1:3], counts[3], counts[4:]
        assert v_first >= 8 and one_first >= 4 and v_later == one_later == [0, 0], counts
    assert reports[0]["relayouts"] == reports[1]["relayouts"] and min(reports[0]["relayouts"]) > 0
