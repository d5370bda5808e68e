"""The loop-placed and V-shaped schedules: literal orders, validity for every shape, simulated steps and memory.

The literal orders of ``zbv`` and ``dualpipe_v`` were checked, for 1 to 4
workers and 1 to 12 micro-batches, against the orders torch 2.13's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` compute (their
``_calculate_single_rank_operations``, DualPipeV's overlapped ``F``+``B``
pairs read as ``F`` then ``B``): identical. ``interleaved_zero_bubble``'s
order differs from ``ScheduleInterleavedZeroBubble``'s but simulates to the
same step for unit costs on the shapes below.
"""
from typing import List

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpipe.schedule import (
    Kind,
    Schedule,
    build,
    dualpipe_v,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    simulate,
    v_stage_workers,
    validate,
    with_recomputation,
    zbv,
)

F, B, BI, BW = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
#: F, I and W of equal cost, a whole backward their sum: the zero-bubble paper's setting.
SPLIT = {F: 1.0, B: 2.0, BI: 1.0, BW: 1.0}


def lists(text: str) -> List[List[str]]:
    return [line.split() for line in text.strip().splitlines()]


def test_looped_bfs_literal() -> None:
    schedule = looped_bfs(3, 4, 2)
    assert schedule.name == "looped_bfs" and schedule.stage_workers == (0, 1, 0, 1)
    assert schedule.as_lists() == lists("""
        0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0
        1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0
    """)


def test_interleaved_zero_bubble_literal() -> None:
    schedule = interleaved_zero_bubble(4, 4, 2)
    assert schedule.name == "interleaved_zero_bubble" and schedule.stage_workers == (0, 1, 0, 1)
    assert schedule.as_lists() == lists("""
        0F0 0F1 2F0 2F1 0F2 2I0 2W0 0F3 2I1 2W1 2F2 0I0 0W0 2F3 0I1 2I2 0W1 2W2 2I3 0I2 0I3 2W3 0W2 0W3
        1F0 1F1 3F0 3I0 3F1 3I1 1F2 1I0 3W0 1F3 1I1 3W1 3F2 3I2 1W0 3F3 3I3 1I2 1I3 1W1 3W2 3W3 1W2 1W3
    """)
    # Its forwards and input gradients keep interleaved 1F1B's order.
    plain = interleaved_1f1b(4, 4, 2)
    for ours, theirs in zip(schedule.workers, plain.workers):
        assert [(a.stage, a.microbatch) for a in ours if a.kind is not BW] == [(a.stage, a.microbatch) for a in theirs]


def test_zbv_literal() -> None:
    schedule = zbv(4, 2)
    assert schedule.name == "zbv" and schedule.stage_workers == (0, 1, 1, 0) == v_stage_workers(2)
    assert schedule.as_lists() == lists("""
        0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
        1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
    """)
    # Fewer micro-batches than 2 * workers - 1: the order for 2W - 1 without the others' actions.
    assert zbv(2, 2).as_lists() == lists("""
        0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1
        1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1
    """)


def test_dualpipe_v_literal() -> None:
    schedule = dualpipe_v(4, 2)
    assert schedule.name == "dualpipev" and schedule.stage_workers == (0, 1, 1, 0)
    assert schedule.as_lists() == lists("""
        0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
    """)
    assert dualpipe_v(6, 3).as_lists()[2] == (
        "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2I4 3I5 2I5 2W4 3W5 2W5"
    ).split()


def test_too_few_microbatches_or_a_wrong_placement_say_what_fits() -> None:
    with pytest.raises(ValueError, match=r"dualpipe_v needs at least 2 \* workers = 6 micro-batches for 3 workers, "
                                         r"got 5; .*'zbv'"):
        dualpipe_v(5, 3)
    with pytest.raises(ValueError, match=r"zbv places 2 stages per worker in a V.*got 3 stages \(use an even"):
        build("zbv", 4, 3)
    with pytest.raises(ValueError, match=r"got 4 stages for 3 workers \(use 6 stages\)"):
        build("dualpipev", 8, 4, 3)
    with pytest.raises(ValueError, match=r"looped_bfs needs .* multiple .at least 2. of the workers; "
                                         r"got 3 stages and 2 workers \(for 2 workers: 4, 6, ... stages\)"):
        looped_bfs(4, 3, 2)
    with pytest.raises(ValueError, match="interleaved_zero_bubble needs"):
        interleaved_zero_bubble(4, 2, 2)


def every_action_once(schedule: Schedule) -> None:
    """Each (stage, micro-batch) has one F and either one B or one I and one W, each once, on its stage's worker."""
    actions = list(schedule.actions())
    assert len(actions) == len(set(actions))
    for s in range(schedule.stages):
        for i in range(schedule.microbatches):
            kinds = sorted(a.kind.value for a in actions if a.stage == s and a.microbatch == i)
            assert kinds in (["B", "F"], ["F", "I", "W"]), (s, i, kinds)
    for w, worker in enumerate(schedule.workers):
        assert all(schedule.stage_workers[a.stage] == w for a in worker)


@given(st.integers(1, 14), st.integers(1, 4), st.integers(2, 3), st.data())
def test_every_new_schedule_is_valid_for_every_shape(m: int, workers: int, chunks: int, data: st.DataObject) -> None:
    stages = workers * chunks
    shapes = [looped_bfs(m, stages, workers), interleaved_zero_bubble(m, stages, workers), zbv(m, workers)]
    if m >= 2 * workers:
        shapes.append(dualpipe_v(m, workers))
    for schedule in shapes:
        assert schedule.microbatches == m
        validate(schedule)
        every_action_once(schedule)
        stop = data.draw(st.integers(0, m))
        validate(with_recomputation(schedule, lambda s, i, stop=stop: i < stop))
        assert build(schedule.name, m, schedule.stages, workers) == schedule


@given(st.integers(1, 4), st.data())
def test_the_v_is_shorter_than_1f1b_on_stages_of_twice_the_cost(workers: int, data: st.DataObject) -> None:
    # F = I = W = 1 on 2W half-size stages, against 1F1B on W whole ones (F = 2, B = 4).
    m = data.draw(st.integers(2 * workers, 24))
    whole = simulate(one_f_one_b(m, workers), {F: 2.0, B: 4.0}).step_time
    assert whole == 6 * (m + workers - 1)
    for schedule in (zbv(m, workers), dualpipe_v(m, workers)):
        step = simulate(schedule, SPLIT).step_time
        assert step < whole or workers == 1, (schedule.name, step, whole)
        assert step >= 6 * m  # each worker's own work
    if workers > 1:
        # The zero-bubble figures: 2 workers x 8 micro-batches 49 against 54, 4 x 8 51 against 66.
        assert simulate(zbv(8, 2), SPLIT).step_time == 49 and simulate(zbv(8, 4), SPLIT).step_time == 51
        assert simulate(dualpipe_v(8, 2), SPLIT).step_time == 49
        assert simulate(dualpipe_v(8, 4), SPLIT).step_time == 51


@pytest.mark.parametrize("workers, chunks, m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (2, 3, 6), (3, 2, 7)])
def test_interleaved_zero_bubble_is_shorter_than_interleaved_1f1b(workers: int, chunks: int, m: int) -> None:
    stages = workers * chunks
    split = simulate(interleaved_zero_bubble(m, stages, workers), SPLIT).step_time
    whole = simulate(interleaved_1f1b(m, stages, workers), SPLIT).step_time
    assert 3 * chunks * m <= split < whole
    # Looped BFS is fill-drain per stage: interleaved 1F1B's step once the micro-batches fill the rounds.
    if m % workers == 0:
        assert simulate(looped_bfs(m, stages, workers), SPLIT).step_time == whole


@given(st.integers(1, 16), st.integers(1, 4))
def test_peak_activations_of_the_new_schedules(m: int, workers: int) -> None:
    assert max(simulate(zbv(m, workers), SPLIT).peak_activations) <= 2 * workers
    if m >= 2 * workers:
        assert simulate(dualpipe_v(m, workers), SPLIT).peak_activations == (2 * workers + 1,) * workers
        assert simulate(zbv(m, workers), SPLIT).peak_activations == (2 * workers,) * workers
    bfs = simulate(looped_bfs(m, 2 * workers, workers), SPLIT).peak_activations
    assert bfs == (2 * m,) * workers  # every micro-batch on both stages at the turn
