"""Pipeline in one process with the loop-placed and V-shaped schedules (issue 36): the plain module's loss and
gradients, with skips, tied weights and every checkpoint mode; placements that do not fit are refused up front."""
import copy
from typing import List

import pytest
import torch

from tests.test_pipeline import MODES, compare, model_for
from tests.test_ties import lm_loss, tied_lm, train_beside_plain
from torchpipe import Pipeline, trace
from torchpipe.schedule import Kind

NEW = ["looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]


@pytest.mark.parametrize("schedule", NEW)
@pytest.mark.parametrize("checkpoint", MODES)
def test_a_skip_model_is_transparent(schedule: str, checkpoint: str) -> None:
    # 4 stages on 2 workers; a second step of 3 rows runs 3 micro-batches, fewer than dualpipev's 2W = 4.
    model = model_for(8, skips=True)
    batches = [(torch.randn(9, 6), torch.randn(9, 6)), (torch.randn(3, 6), torch.randn(3, 6))]
    compare(model, [2, 2, 2, 2], schedule, 4, checkpoint, batches)


@pytest.mark.parametrize("schedule", NEW)
@pytest.mark.parametrize("checkpoint", MODES)
def test_a_tied_embedding_and_head_is_transparent_over_steps(schedule: str, checkpoint: str) -> None:
    # In the V the embedding (stage 0) and the head (stage 3) are both worker 0's; in the loop, workers 0 and 1's.
    model = tied_lm()
    plain = copy.deepcopy(model)
    pipe = Pipeline(model, [3, 2, 2, 3], chunks=4, schedule=schedule, loss_fn=lm_loss, checkpoint=checkpoint)
    train_beside_plain(pipe, plain, lambda params: torch.optim.SGD(params, lr=0.1), steps=2, batch=8)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_v_runs_two_stages_per_worker_as_written(schedule: str) -> None:
    pipe = Pipeline(model_for(6), [2, 1, 1, 2], chunks=4, schedule=schedule, loss_fn=torch.nn.functional.mse_loss)
    assert pipe.schedule_name == schedule and pipe.schedule.name == schedule
    assert pipe.schedule.stage_workers == (0, 1, 1, 0)
    with trace.record_timeline() as timeline:
        pipe.step(torch.randn(8, 6), torch.randn(8, 6))
    ran: List[List[str]] = [[], []]
    for span in sorted(timeline.spans, key=lambda s: s.start):
        if span.kind != "copy":
            ran[pipe.schedule.stage_workers[span.partition]].append(str(span.action))
    assert ran == pipe.schedule.as_lists()
    names = sorted({w.thread.name for w in pipe._runner.stages.workers().workers})
    assert len(names) == 2, names
    assert {a.kind for a in pipe.schedule.actions()} >= {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}


def test_loop_placed_schedules_take_one_worker_per_device() -> None:
    for schedule in ("looped_bfs", "interleaved_zero_bubble"):
        pipe = Pipeline(model_for(6), [1] * 6, chunks=3, schedule=schedule, devices=["cpu"] * 3)
        assert pipe.schedule.stage_workers == (0, 1, 2, 0, 1, 2)
        default = Pipeline(model_for(6), [1] * 6, chunks=3, schedule=schedule)
        assert default.schedule.stage_workers == (0, 1, 2, 0, 1, 2), "one worker per two stages by default"


def test_placements_that_do_not_fit_are_refused_before_anything_runs() -> None:
    model = model_for(6)
    with pytest.raises(ValueError, match=r"zbv places 2 stages per worker in a V .* balance needs an even number "
                                         r"of entries, 2 \* workers; got 3"):
        Pipeline(model, [2, 2, 2], chunks=4, schedule="zbv")
    with pytest.raises(ValueError, match=r"dualpipev needs chunks >= 2 \* workers = 4 \(2 workers for 4 stages\), "
                                         r"got chunks=3; use chunks=4 or more, or schedule='zbv'"):
        Pipeline(model, [2, 2, 1, 1], chunks=3, schedule="dualpipev")
    with pytest.raises(ValueError, match=r"looped_bfs needs .* got 4 stages for 3 workers \(one per entry of "
                                         r"devices\); balance needs 6, 9, ... entries"):
        Pipeline(model, [2, 2, 1, 1], chunks=3, schedule="looped_bfs", devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="interleaved_zero_bubble needs"):
        Pipeline(model, [3, 3], chunks=3, schedule="interleaved_zero_bubble", devices=["cpu"] * 2)
