"""merge_backwards: a split backward whose W fills no gap runs whole, and a Pipeline runs the named schedules so.

The story: on this project's CPU a split backward costs 1.14 to 1.19 times the
whole one (``benchmarks/experiments/split_backward.py``), so ``zbv`` and
``interleaved_zero_bubble`` sat 9 to 14 % above their machine lines in one
process: they paid the split on every backward, also where its ``W`` filled
no bubble. Merged, only the gap-fillers stay split.
"""
import doctest
import random
from typing import Callable, Dict, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchpipe.schedule.merge
from tests.test_pipeline import model_for
from torchpipe import Pipeline, trace
from torchpipe.schedule import (
    DEFAULT_COSTS,
    Action,
    Kind,
    Schedule,
    build,
    gpipe,
    interleaved_zero_bubble,
    merge_backwards,
    one_f_one_b,
    simulate,
    validate,
    with_recomputation,
    zbv,
    zero_bubble,
)
from torchpipe.schedule.split import SplitTuner

F, B, BI, BW = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
#: The zero-bubble paper's costs, the simulation's default: the whole backward costs its two halves.
PAPER = DEFAULT_COSTS
#: This CPU's: each half 1.15 of the paper's (benchmarks/experiments/split_backward.py: the split is 1.14 to 1.19 of B).
CPU = {F: 1.0, B: 2.0, BI: 1.15, BW: 1.15}


def test_the_docstring_examples_hold() -> None:
    failures, tried = doctest.testmod(torchpipe.schedule.merge, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried > 0 and failures == 0


def test_zbv_keeps_its_step_and_memory_and_runs_most_backwards_whole() -> None:
    # zbv on 2 workers, 8 micro-batches: 28 of its 32 split backwards fill no gap.
    schedule = zbv(8, 2)
    merged = merge_backwards(schedule)
    validate(merged)
    assert merged.name == "zbv" and merged.stage_workers == schedule.stage_workers
    assert sum(a.kind is B for a in merged.actions()) == 28
    assert simulate(merged, PAPER).step_time == simulate(schedule, PAPER).step_time == 49.0
    assert simulate(merged, PAPER).peak_activations == simulate(schedule, PAPER).peak_activations == (4, 4)
    # Where the split costs what it costs here, the merged step is 8 % shorter: zbv's bubble, without the split's
    # price on every backward.
    assert simulate(merged, CPU).step_time <= 0.93 * simulate(schedule, CPU).step_time
    assert simulate(merged, CPU).step_time < simulate(one_f_one_b(8, 2), {F: 2.0, B: 4.0}).step_time


def test_interleaved_zero_bubble_runs_whole_backwards_where_its_ws_fill_nothing() -> None:
    schedule = interleaved_zero_bubble(8, 4, 2)
    merged = merge_backwards(schedule)
    assert 0 < sum(a.kind is B for a in merged.actions()) < 32
    assert simulate(merged, PAPER).step_time == simulate(schedule, PAPER).step_time
    assert simulate(merged, CPU).step_time <= 0.98 * simulate(schedule, CPU).step_time


def test_a_schedule_without_a_split_backward_is_returned_as_it_is() -> None:
    for schedule in (gpipe(4, 2), one_f_one_b(4, 3), zero_bubble(4, 3, [False] * 3)):
        assert merge_backwards(schedule) is schedule


def test_a_whole_backward_that_would_be_late_stays_split() -> None:
    # A first stage that waits for its last input gradient: the second worker's last I sends it early, and its
    # W runs after; made whole, the first worker would wait for the W too.
    schedule = Schedule.from_lists([["0F0", "0B0"], ["1F0", "1I0", "1W0"]])
    assert merge_backwards(schedule) == schedule
    # Where nobody waits (the first stage: no input gradient goes anywhere), it is merged.
    alone = Schedule.from_lists([["0F0", "0I0", "0W0"], ["1F0", "1B0"]])
    assert merge_backwards(alone).as_lists() == [["0F0", "0B0"], ["1F0", "1B0"]]


def test_given_costs_merge_what_pays_at_those_costs() -> None:
    # A whole backward that costs more than its halves (the halves overlap nothing) is never made whole where
    # it would lengthen a worker's work on the critical path.
    dear = {F: 1.0, B: 3.0, BI: 1.0, BW: 1.0}
    schedule = zero_bubble(4, 1)
    assert merge_backwards(schedule, dear) == schedule
    assert merge_backwards(schedule, CPU).as_lists() == [["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3"]]


SPLITTING_SHAPES = st.one_of(
    st.tuples(st.just("zero_bubble"), st.integers(1, 4).map(lambda w: (w, w))),
    st.tuples(st.sampled_from(["zbv", "dualpipev"]), st.integers(1, 3).map(lambda w: (2 * w, w))),
    st.tuples(st.just("interleaved_zero_bubble"),
              st.tuples(st.integers(1, 3), st.integers(2, 3)).map(lambda wc: (wc[0] * wc[1], wc[0]))),
)


@settings(max_examples=150, deadline=None)
@given(SPLITTING_SHAPES, st.integers(1, 10), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.0, 0.4, 1.5]),
       st.booleans())
def test_merging_never_lengthens_the_step_nor_raises_memory(
    shape: Tuple[str, Tuple[int, int]], m: int, seed: int, communication: float, recompute: bool
) -> None:
    name, (stages, workers) = shape
    if name == "dualpipev":
        m = max(m, 2 * workers)
    schedule = build(name, m, stages, workers)
    if recompute:
        schedule = with_recomputation(schedule, lambda s, i: (s + i) % 2 == 0)
    # Costs per stage and kind, a whole backward from a bit cheaper to a bit dearer than its halves.
    rng = random.Random(seed)
    table: Dict[Tuple[int, Kind], float] = {}
    for s in range(stages):
        for kind in (F, Kind.RECOMPUTE, BI, BW):
            table[(s, kind)] = rng.uniform(0.2, 3.0)
        table[(s, B)] = table[(s, BI)] + table[(s, BW)] * rng.uniform(0.5, 1.2)
    cost: Callable[[Action], float] = lambda a: table[(a.stage, a.kind)]  # noqa: E731
    for costs in (None, cost):
        merged = merge_backwards(schedule, costs, communication=communication)
        validate(merged)
        before = simulate(schedule, cost if costs else None, communication=communication)
        after = simulate(merged, cost if costs else None, communication=communication)
        assert after.step_time <= before.step_time + 1e-9
        assert all(a <= b for a, b in zip(after.peak_activations, before.peak_activations))
        # The same lists, each merged I a B in its place and its W gone.
        whole = {Action(a.stage, BI, a.microbatch) for a in merged.actions() if a.kind is B}
        expected = [[Action(a.stage, B, a.microbatch) if a in whole else a for a in actions
                     if not (a.kind is BW and Action(a.stage, BI, a.microbatch) in whole)]
                    for actions in schedule.workers]
        assert [list(actions) for actions in merged.workers] == expected


def test_a_pipeline_runs_a_named_schedule_merged_and_a_custom_one_as_given() -> None:
    model = model_for(6)
    pipe = Pipeline(model, [2, 1, 1, 2], chunks=8, schedule="zbv", loss_fn=torch.nn.functional.mse_loss)
    assert pipe.schedule == merge_backwards(zbv(8, 2))
    with trace.record_timeline() as timeline:
        pipe.step(torch.randn(16, 6), torch.randn(16, 6))
    ran = sorted(str(span.action) for span in timeline.spans if span.action is not None)
    assert ran == sorted(map(str, pipe.schedule.actions()))
    custom = Pipeline(model_for(6), [2, 1, 1, 2], chunks=8, schedule=zbv(8, 2), loss_fn=torch.nn.functional.mse_loss)
    assert custom.schedule == zbv(8, 2), "a schedule the user built runs as it is"


@pytest.mark.parametrize("placement", ["measuring", "decided"])
def test_zero_bubble_measures_every_split_then_runs_merged(placement: str) -> None:
    tuner = SplitTuner(3)
    tuner.record({(s, kind): [PAPER[kind]] for s in range(3) for kind in (F, B)})  # the whole backward measured
    measuring = tuner.plan(6)
    # Every stage's I and W are timed on the next step: none merged.
    assert measuring == zero_bubble(6, 3)
    if placement == "decided":  # the split the costs chose, tried against 1F1B, runs merged at those costs (ZB-H1's
        # W's fill its gaps here: each I's gradient is awaited upstream at once, so its W waits)
        tuner.record({(s, kind): [CPU[kind]] for s in range(3) for kind in (F, BI, BW)})
        assert tuner.candidate is not None and any(tuner.split)
        expected = merge_backwards(zero_bubble(6, 3, tuner.split), lambda a: CPU[a.kind])
        assert tuner.plan(6) == expected
