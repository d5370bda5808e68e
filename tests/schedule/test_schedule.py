"""The schedule is data: literal equality, string forms, validation and simulation."""
from typing import Dict, List, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpipe.schedule import (
    Action,
    Kind,
    Schedule,
    build,
    choose_split,
    clock_cycles,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    merge_backwards,
    one_f_one_b,
    parse,
    simulate,
    validate,
    with_recomputation,
    zero_bubble,
)

F, B, BI, BW = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
UNIT = {F: 1.0, B: 1.0}
SPLIT_UNIT = {F: 1.0, BI: 1.0, BW: 1.0}


def lists(text: str) -> List[List[str]]:
    return [line.split() for line in text.strip().splitlines()]


def test_action_string_form_round_trips() -> None:
    action = Action(1, Kind.FORWARD, 0)
    assert str(action) == "1F0" and action.partition == 1
    assert parse("1F0") == action
    assert parse("12B3") == Action(12, Kind.BACKWARD, 3)
    assert parse("2I4") == Action(2, Kind.BACKWARD_INPUT, 4)
    assert parse("2W4") == Action(2, Kind.BACKWARD_WEIGHT, 4)
    assert parse(action) is action
    with pytest.raises(ValueError, match="not an action"):
        parse("1X0")


def test_kind_labels() -> None:
    assert [k.label for k in Kind] == ["forward", "recompute", "backward", "backward-input", "backward-weight"]
    assert all(Kind.from_label(k.label) is k for k in Kind)
    with pytest.raises(ValueError):
        Kind.from_label("copy")


def test_gpipe_literal() -> None:
    assert gpipe(3, 2).as_lists() == lists("""
        0F0 0F1 0F2 0B2 0B1 0B0
        1F0 1F1 1F2 1B2 1B1 1B0
    """)


def test_gpipe_with_recomputation_literal() -> None:
    schedule = with_recomputation(gpipe(3, 2), lambda s, i: i < 2)
    assert schedule.as_lists() == lists("""
        0F0 0F1 0F2 0B2 0R1 0B1 0R0 0B0
        1F0 1F1 1F2 1B2 1R1 1B1 1R0 1B0
    """)


def test_one_f_one_b_literal() -> None:
    assert one_f_one_b(4, 3).as_lists() == lists("""
        0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
        2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
    """)


def test_one_f_one_b_with_fewer_microbatches_than_stages() -> None:
    assert one_f_one_b(2, 4).as_lists() == lists("""
        0F0 0F1 0B0 0B1
        1F0 1F1 1B0 1B1
        2F0 2F1 2B0 2B1
        3F0 3B0 3F1 3B1
    """)


def test_interleaved_literal() -> None:
    schedule = interleaved_1f1b(4, 4, 2)
    assert schedule.stage_workers == (0, 1, 0, 1)
    assert schedule.stages_of(1) == [1, 3]
    assert schedule.as_lists() == lists("""
        0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """)


def test_zero_bubble_literal() -> None:
    assert zero_bubble(4, 3).as_lists() == lists("""
        0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
        2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
    """)


@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_every_named_schedule_is_valid_for_every_shape(m: int, p: int, data: st.DataObject) -> None:
    for name in ("gpipe", "1f1b", "zero_bubble"):
        schedule = build(name, m, p)
        assert schedule.microbatches == m and schedule.stages == p and schedule.name == name
        validate(schedule)
        stop = data.draw(st.integers(0, m))
        validate(with_recomputation(schedule, lambda s, i, stop=stop: i < stop))
    workers = data.draw(st.integers(1, 4))
    chunks = data.draw(st.integers(2, 3))
    validate(interleaved_1f1b(m, workers * chunks, workers))


@given(st.integers(1, 12), st.integers(1, 6))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(m: int, p: int) -> None:
    expected = (p - 1) / (m + p - 1)
    assert simulate(gpipe(m, p), UNIT).bubble == pytest.approx(expected)
    assert simulate(one_f_one_b(m, p), UNIT).bubble == pytest.approx(expected)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_bubble_divides_by_the_stages_per_worker(workers: int, chunks: int, rounds: int) -> None:
    m = rounds * workers
    simulation = simulate(interleaved_1f1b(m, workers * chunks, workers), UNIT)
    assert simulation.bubble == pytest.approx((workers - 1) / (chunks * m + workers - 1))


@given(st.integers(1, 6), st.data())
def test_zero_bubble_has_a_third_of_the_1f1b_bubble(p: int, data: st.DataObject) -> None:
    # The zero-bubble paper's ZB-H1 with F, I and W of equal cost: 3m + p - 1 time units against 1F1B's
    # 3m + 3(p - 1), its backward B costing I + W.
    m = data.draw(st.integers(p, 14))
    zb = simulate(zero_bubble(m, p), SPLIT_UNIT)
    f1b = simulate(one_f_one_b(m, p), {F: 1.0, B: 2.0})
    assert zb.step_time == 3 * m + p - 1
    assert f1b.step_time == 3 * m + 3 * (p - 1)
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1))


def live_microbatches(schedule: Schedule, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once, in its list's order."""
    live = peak = 0
    for action in schedule.workers[schedule.stage_workers[stage]]:
        if action.stage != stage:
            continue
        if action.kind is F:
            live += 1
        elif action.kind in (B, BW):
            live -= 1
        peak = max(peak, live)
    return peak


@given(st.integers(1, 16), st.integers(1, 6))
def test_memory_bound_of_each_schedule(m: int, p: int) -> None:
    for s in range(p):
        assert live_microbatches(gpipe(m, p), s) == m
        assert live_microbatches(one_f_one_b(m, p), s) <= p - s
        assert live_microbatches(zero_bubble(m, p), s) <= p
    interleaved = interleaved_1f1b(m, 2 * max(p // 2, 1), max(p // 2, 1))
    assert all(live_microbatches(interleaved, s) <= interleaved.stages for s in range(interleaved.stages))


def test_unit_clock_cycles_of_gpipe() -> None:
    cycles = clock_cycles(gpipe(4, 3).only([F]))
    assert len(cycles) == 4 + 3 - 1
    for k, cycle in enumerate(cycles):
        assert sorted(str(a) for a in cycle) == sorted(f"{j}F{k - j}" for j in range(3) if 0 <= k - j < 4)
    backward = clock_cycles(gpipe(3, 3).only([B]))
    assert [sorted(map(str, c)) for c in backward] == [
        ["2B2"], ["1B2", "2B1"], ["0B2", "1B1", "2B0"], ["0B1", "1B0"], ["0B0"]
    ]


def test_simulate_with_costs_and_communication() -> None:
    simulation = simulate(gpipe(2, 2), {F: 2.0, B: 3.0}, communication=0.5)
    # 0F0 0..2, 0F1 2..4; 1F0 2.5..4.5, 1F1 4.5..6.5; 1B1 6.5..9.5, 1B0 9.5..12.5; 0B1 10..13, 0B0 13..16
    assert simulation.step_time == 16.0
    assert simulation.busy == (10.0, 10.0)
    assert simulation.start[parse("0B0")] == 13.0
    assert simulate(gpipe(2, 2), lambda a: 1.0).step_time == 6.0


def test_validate_reports_every_problem() -> None:
    bad = Schedule.from_lists([["0B0", "0F0", "0F0", "0I1"], ["1F0"]])
    with pytest.raises(ValueError) as info:
        validate(bad)
    message = str(info.value)
    for problem in [
        "0F0 appears twice",
        "0B0 comes before its forward",
        "0F1 is missing",
        "0I1 has no 0W1",
        "1B0 is missing (or 1I0 and 1W0)",
        "schedule deadlocks",
    ]:
        assert problem in message
    assert "problems" in message and "worker 0: 0B0 0F0 0F0 0I1" in message


def test_validate_detects_deadlock_and_names_the_waits() -> None:
    # Stage 0 waits for 1B0 before 0F1, but stage 1 needs 0F1 before it runs 1B0.
    deadlocked = Schedule.from_lists([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B1", "1B0"]])
    with pytest.raises(ValueError, match="deadlocks.*0B0 waits for 1B0; 1F1 waits for 0F1"):
        validate(deadlocked)


def test_validate_rejects_misplaced_and_out_of_range_actions() -> None:
    with pytest.raises(ValueError, match="1F0 is in the list of worker 0, but stage 1 runs on worker 1"):
        validate(Schedule.from_lists([["1F0"], ["1F0"]], stage_workers=[0, 1]), backward=False)
    with pytest.raises(ValueError, match="names a micro-batch outside 0..0"):
        validate(Schedule.from_lists([["0F0", "0F1", "0B0", "0B1"]], microbatches=1))
    with pytest.raises(ValueError, match="0W0 comes before its 0I0"):
        validate(Schedule.from_lists([["0F0", "0W0", "0I0"]]))
    with pytest.raises(ValueError, match="both a whole and a split backward"):
        validate(Schedule.from_lists([["0F0", "0B0", "0I0", "0W0"]]))
    with pytest.raises(ValueError, match="0R0 comes after its backward"):
        validate(Schedule.from_lists([["0F0", "0B0", "0R0"]]))


def test_restricted_keeps_a_valid_schedule_for_fewer_microbatches() -> None:
    schedule = one_f_one_b(6, 3).restricted(2)
    assert schedule.microbatches == 2
    validate(schedule)
    assert all(a.microbatch < 2 for a in schedule.actions())


def test_build_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build("pipedream", 4, 2)
    with pytest.raises(ValueError, match="multiple .at least 2. of the workers"):
        interleaved_1f1b(4, 3, 2)


def test_the_runner_executes_the_gpipe_schedule_cut_into_phases() -> None:
    import torch

    from tests.models import mlp
    from torchpipe import GPipe

    model = GPipe(mlp(3, 4), [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    plan = model._runner.plan(4, 3)
    assert plan is model._runner.plan(4, 3)  # computed once per shape
    expected = with_recomputation(gpipe(4, 3), lambda s, i: i < 3)
    assert plan.schedule == expected
    assert plan.forward == expected.only([F])
    assert plan.backward == expected.only([Kind.RECOMPUTE, B, BI, BW])
    assert plan.inline == ()  # CPU: every partition on its worker
    model(torch.randn(8, 4)).sum().backward()
    assert model._runner.plan(4, 3) is plan


# --- zero-bubble placement (issue 18) -------------------------------------------------------------------------


def test_a_zero_bubble_schedule_without_splits_is_1f1b_and_a_partial_one_is_valid() -> None:
    assert zero_bubble(8, 3, [False] * 3).as_lists() == one_f_one_b(8, 3).as_lists()
    mixed = zero_bubble(8, 3, [False, True, True])
    validate(mixed)
    assert {a.kind for a in mixed.actions() if a.stage == 0} == {Kind.FORWARD, Kind.BACKWARD}
    assert {a.kind for a in mixed.actions() if a.stage == 2} == {Kind.FORWARD, Kind.BACKWARD_INPUT,
                                                                  Kind.BACKWARD_WEIGHT}
    with pytest.raises(ValueError, match="split has 2 entries for 3 stages"):
        zero_bubble(8, 3, [True, True])


def test_choose_split_splits_only_where_it_shortens_the_step() -> None:
    # Measured on this CPU once: I and W together cost 1.4 B, so splitting lengthens every stage's work. A split
    # stage runs with its backwards whole where W fills no gap (merge_backwards), so a split may still pay in the
    # cool-down: only there, in one backward per stage at most, and only if the step is shorter than 1F1B's.
    cpu = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.BACKWARD_INPUT: 1.2, Kind.BACKWARD_WEIGHT: 1.6}
    chosen = merge_backwards(zero_bubble(8, 4, choose_split(8, 4, lambda s, k: cpu[k])), cpu)
    weights = [a for a in chosen.actions() if a.kind is Kind.BACKWARD_WEIGHT]
    assert len(weights) == len({a.stage for a in weights}) and all(a.microbatch == 7 for a in weights)
    assert simulate(chosen, cpu).step_time <= simulate(one_f_one_b(8, 4), cpu).step_time
    # The paper's costs (I + W = B): W fills the bubbles of the stages that wait.
    even = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0}
    split = choose_split(8, 4, lambda s, k: even[k])
    assert any(split)
    costs = lambda s, k: even[k]  # noqa: E731
    assert simulate(zero_bubble(8, 4, split), lambda a: costs(a.stage, a.kind)).step_time < \
        simulate(one_f_one_b(8, 4), lambda a: costs(a.stage, a.kind)).step_time
    # Measured once on this CPU (ms): a first stage whose input needs no gradient has a nearly free I and a W
    # that is its whole backward, which fills the bubble; the last stage's I and W cost far more than its B.
    measured = {(0, F): 1.3, (0, B): 3.3, (1, F): 2.1, (1, B): 2.9, (0, BI): 0.15, (0, BW): 2.8, (1, BI): 2.3,
                (1, BW): 3.1}
    assert choose_split(8, 2, lambda s, k: measured[(s, k)]) == [True, False]


# --- peak activations (issue 36) -----------------------------------------------------------------------------


@given(st.integers(1, 16), st.integers(1, 6))
def test_peak_activations_of_gpipe_and_1f1b(m: int, p: int) -> None:
    for costs in (UNIT, {F: 1.0, B: 2.0}, lambda a: 1.0 + 0.3 * a.stage + (0.5 if a.kind is B else 0.0)):
        assert simulate(gpipe(m, p), costs).peak_activations == (m,) * p
        assert simulate(one_f_one_b(m, p), costs).peak_activations == tuple(min(m, p - w) for w in range(p))
    # Split backwards hold a micro-batch until its W: at most p on every stage, p on the first.
    zb = simulate(zero_bubble(m, p), SPLIT_UNIT).peak_activations
    assert zb[0] == min(m, p) and max(zb) <= p


def test_peak_activations_count_a_pair_from_its_forwards_start_to_its_backwards_end() -> None:
    # Worker 0 runs 0F0 0F1 2F0 2F1 2B0 ...: four pairs held when 2F1 ends; worker 1 1F0 1F1 3F0 3B0 3F1 ...: three.
    interleaved = interleaved_1f1b(2, 4, 2)
    simulation = simulate(interleaved, UNIT)
    assert simulation.peak_activations == (4, 3)
    # A pair that ends at an instant and one that starts then do not overlap: 1F1B's last stage holds one.
    assert simulate(one_f_one_b(4, 2), UNIT).peak_activations == (2, 1)
    # A forward-only schedule holds every pair to the step's end.
    assert simulate(gpipe(3, 2).only([F]), UNIT).peak_activations == (3, 3)


@given(st.integers(1, 8), st.integers(1, 4))
def test_peak_activations_count_pairs_held_for_no_time(m: int, p: int) -> None:
    # A stage whose actions cost nothing held its pairs for no time, and the count dropped them: GPipe's free last
    # stage held m - 1, and with every cost 0 no worker held any, so choose()'s memory bound passed every schedule
    # (found in review, issue 36). At one instant the worker's actions now count in their order.
    free_last = lambda a: 0.0 if a.stage == p - 1 else 1.0  # noqa: E731
    assert simulate(gpipe(m, p), free_last).peak_activations == (m,) * p
    assert simulate(gpipe(m, p), lambda a: 0.0).peak_activations == (m,) * p
    assert simulate(one_f_one_b(m, p), lambda a: 0.0).peak_activations == tuple(min(m, p - w) for w in range(p))


def test_order_breaks_a_tie_in_start_by_end() -> None:
    simulation = simulate(gpipe(2, 2), lambda a: (2.0 if a.stage == 0 else 1.0) if a.kind is F else 1.0)
    assert [str(a) for a in simulation.order()[:3]] == ["0F0", "1F0", "0F1"]  # 1F0 ends first at the tie at 2


def test_a_flat_list_of_actions_says_a_schedule_is_one_list_per_worker() -> None:
    # A flat list was read as one list per worker, each string character by character: "not an action: '0'".
    for flat in (["0F0", "0B0"], "0F0", [Action(0, F, 0)]):
        with pytest.raises(ValueError, match=r"one list of actions per worker.*write \[\['0F0'"):
            Schedule.from_lists(flat)  # type: ignore[arg-type]


def test_a_v_for_too_few_workers_or_stages_says_what_fits() -> None:
    with pytest.raises(ValueError, match="zbv needs at least 1 worker, got 0"):
        build("zbv", 4, 2, 0)
    with pytest.raises(ValueError, match=r"got 1 stages \(use an even number, at least 2: 2\)"):
        build("zbv", 4, 1)
    with pytest.raises(ValueError, match="at least 2: 2 or 4"):
        build("dualpipev", 4, 3)


# --- peak bytes ---------------------------------------------------------------------------------------------


@given(st.integers(1, 12), st.integers(1, 5), st.lists(st.integers(0, 1 << 30), min_size=5, max_size=5))
def test_peak_bytes_weigh_each_held_pair_by_its_stages_size(m: int, p: int, sizes: List[int]) -> None:
    sizes = sizes[:p]
    assert simulate(gpipe(m, p), sizes=sizes).peak_bytes == tuple(float(m * size) for size in sizes)
    assert simulate(one_f_one_b(m, p), sizes=sizes).peak_bytes == tuple(
        float(min(m, p - w) * sizes[w]) for w in range(p))
    # Equal sizes: the pairs' count times the size, for any schedule.
    run = simulate(zero_bubble(m, p), SPLIT_UNIT, sizes=[7] * p)
    assert run.peak_bytes == tuple(7.0 * held for held in run.peak_activations)


def test_peak_bytes_per_micro_batch_and_recomputed_graphs() -> None:
    # 1F1B on 2 workers, 4 micro-batches: worker 0 holds micro-batches 0 and 1, then 1 and 2, then 2 and 3.
    run = simulate(one_f_one_b(4, 2), sizes=[[1, 10, 100, 1000], 5])
    assert run.peak_bytes == (1100.0, 5.0)
    # Every micro-batch checkpointed: its input (1 byte) from F to B, its graph (50) from R to B, one at a time.
    recomputing = with_recomputation(one_f_one_b(4, 2), lambda s, i: True)
    assert simulate(recomputing, sizes=[1, 1], recomputed=[50, 50]).peak_bytes == (52.0, 51.0)


def test_a_stages_gradients_are_held_from_its_first_backward_to_the_steps_end() -> None:
    # looped_bfs, 4 stages on 2 workers, 2 micro-batches: worker 0 runs 0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0.
    schedule = looped_bfs(2, 4, 2)
    sizes = [1, 1, 100, 1]
    # Stage 0's gradients come with its first backward, once stage 2 has let go of its 200 bytes: 2 + 5000.
    assert simulate(schedule, sizes=sizes, gradients=[5000, 0, 0, 0]).peak_bytes == (5002.0, 4.0)
    # Stage 2's come while every pair is held: 202 + 5000, and stay to the end.
    assert simulate(schedule, sizes=sizes, gradients=[0, 0, 5000, 0]).peak_bytes == (5202.0, 4.0)
    # A split backward's deferred gradients, from its I to its W: ZB-H1's worker 1 runs 1I0 1F1 1I1 1W0, two at
    # once; worker 0 runs each W right after its I.
    assert simulate(zero_bubble(4, 2), SPLIT_UNIT, deferred=[1, 1]).peak_bytes == (1.0, 2.0)
    # Gradients alone (no sizes) are a peak of their own; one figure per stage, bytes.
    assert simulate(gpipe(2, 2), gradients=[3, 4]).peak_bytes == (3.0, 4.0)
    with pytest.raises(ValueError, match=r"gradients needs one entry per stage \(2\)"):
        simulate(gpipe(2, 2), gradients=[1])
    with pytest.raises(ValueError, match=r"gradients\[0\] must be bytes"):
        simulate(gpipe(2, 2), gradients=[-1, 0])


@pytest.mark.parametrize("costs", [None, {kind: 0.0 for kind in Kind}], ids=["timed", "instant"])
def test_a_backwards_temporaries_are_held_while_it_runs(costs: Optional[Dict[Kind, float]]) -> None:
    # 1F1B, 2 workers, 4 micro-batches; worker 0 runs 0F0 0F1 0B0 0F2 0B1 ..., worker 1 0F0's B right after its F.
    schedule = one_f_one_b(4, 2)
    # A backward's 10 bytes come on top of the pairs held (2 on worker 0, 1 on worker 1) and go as it ends; in
    # no time at all (every action instant), too.
    assert simulate(schedule, costs, sizes=[1, 1], temporaries=[10, 10]).peak_bytes == (12.0, 11.0)
    # With temporaries, the first backward's are where its gradients are made: they are held from its end, so
    # the peak is the second backward's: worker 0's 2 pairs, the gradients and its temporaries.
    run = simulate(schedule, costs, sizes=[1, 1], gradients=[100, 100], temporaries=[10, 10])
    assert run.peak_bytes == (112.0, 111.0)
    # Without, they are held from the first backward's start.
    assert simulate(schedule, costs, sizes=[1, 1], gradients=[100, 100]).peak_bytes == (102.0, 101.0)
    # Temporaries smaller than the gradients: the first backward holds at least the gradients it makes (GPipe's
    # worker 0: its 8 pairs and 100 bytes, as it starts).
    run = simulate(gpipe(8, 2), costs, sizes=[40, 10], gradients=[100, 100], temporaries=[0, 0])
    assert run.peak_bytes == (420.0, 180.0)
    # A split backward's I and W each hold theirs while they run: ZB-H1's worker 0 runs each W right after its I.
    assert simulate(zero_bubble(4, 2), SPLIT_UNIT, temporaries=[[5, 6, 7, 8], 1]).peak_bytes == (8.0, 1.0)
    with pytest.raises(ValueError, match=r"temporaries\[0\] must be bytes"):
        simulate(schedule, temporaries=[-1, 0])


def test_peak_bytes_need_sizes_for_every_stage() -> None:
    with pytest.raises(ValueError, match=r"simulate\(\.\.\., sizes="):
        _ = simulate(gpipe(2, 2)).peak_bytes
    with pytest.raises(ValueError, match=r"sizes needs one entry per stage \(2\)"):
        simulate(gpipe(2, 2), sizes=[1])
    with pytest.raises(ValueError, match=r"sizes\[1\] must be bytes"):
        simulate(gpipe(2, 2), sizes=[1, -1])
    with pytest.raises(ValueError, match=r"sizes\[0\] has 3 figures for the schedule's 2 micro-batches"):
        simulate(gpipe(2, 2), sizes=[[1, 2, 3], 1])
