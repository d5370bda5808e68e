"""The schedule is data: literal equality, string forms, validation and simulation."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpipe.schedule import Action, Kind, clock_cycles, fill_drain, parse, phase, validate


def strs(schedule: list) -> list:
    return [[str(a) for a in actions] for actions in schedule]


def test_action_string_form_round_trips() -> None:
    action = Action(1, Kind.FORWARD, 0)
    assert str(action) == "1F0"
    assert parse("1F0") == action
    assert parse("12B3") == Action(12, Kind.BACKWARD, 3)
    with pytest.raises(ValueError, match="not an action"):
        parse("1X0")


def test_fill_drain_literal() -> None:
    assert strs(fill_drain(3, 2, checkpoint_stop=2)) == [
        ["0F0", "0F1", "0F2", "0B2", "0R1", "0B1", "0R0", "0B0"],
        ["1F0", "1F1", "1F2", "1B2", "1R1", "1B1", "1R0", "1B0"],
    ]
    assert strs(fill_drain(2, 1)) == [["0F0", "0F1", "0B1", "0B0"]]


def test_forward_clock_cycles_are_i_plus_j() -> None:
    cycles = clock_cycles(phase(fill_drain(4, 3), [Kind.FORWARD]))
    assert len(cycles) == 4 + 3 - 1
    for k, cycle in enumerate(cycles):
        assert sorted(str(a) for a in cycle) == sorted(f"{j}F{k - j}" for j in range(3) if 0 <= k - j < 4)


def test_backward_runs_in_reverse() -> None:
    cycles = clock_cycles(phase(fill_drain(3, 3), [Kind.BACKWARD]))
    assert [sorted(map(str, c)) for c in cycles] == [
        ["2B2"], ["1B2", "2B1"], ["0B2", "1B1", "2B0"], ["0B1", "1B0"], ["0B0"]
    ]


def test_recomputation_overlaps_with_later_partitions_backward() -> None:
    cycles = clock_cycles(phase(fill_drain(3, 2, checkpoint_stop=3), [Kind.RECOMPUTE, Kind.BACKWARD]))
    # Partition 0 recomputes micro-batch 2 while partition 1 recomputes and runs its backward.
    assert sorted(map(str, cycles[0])) == ["0R2", "1R2"]


@given(st.integers(1, 8), st.integers(1, 6), st.data())
def test_fill_drain_is_valid(m: int, n: int, data: st.DataObject) -> None:
    stop = data.draw(st.integers(0, m))
    validate(fill_drain(m, n, stop), m)


def test_validate_reports_every_problem() -> None:
    bad = [[Action(0, Kind.BACKWARD, 0), Action(0, Kind.FORWARD, 0), Action(0, Kind.FORWARD, 0)]]
    with pytest.raises(ValueError) as info:
        validate(bad, 1)
    message = str(info.value)
    assert "0F0 appears twice" in message
    assert "0B0 comes before its forward" in message


def test_validate_detects_deadlock() -> None:
    # Partition 0 waits for 1B0 before 0F1, but partition 1 needs 0F1 before it runs 1B0.
    deadlocked = [
        ["0F0", "0B0", "0F1", "0B1"],
        ["1F0", "1F1", "1B1", "1B0"],
    ]
    with pytest.raises(ValueError, match="deadlock"):
        validate([[parse(a) for a in actions] for actions in deadlocked], 2)


def test_validate_rejects_foreign_and_missing_actions() -> None:
    with pytest.raises(ValueError, match="is in the list of partition 0"):
        validate([[parse("1F0")], [parse("1F0")]], 1, backward=False)
    with pytest.raises(ValueError, match="0B0 is missing"):
        validate([[parse("0F0")]], 1)


def test_the_runner_executes_the_fill_drain_schedule_cut_into_phases() -> None:
    import torch

    from tests.models import mlp
    from torchpipe import GPipe

    model = GPipe(mlp(3, 4), [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    plan = model._pipeline.plan(4, 3)
    assert plan is model._pipeline.plan(4, 3)  # computed once per shape
    assert plan.schedule == fill_drain(4, 3, 3)
    assert strs(plan.forward) == strs(phase(fill_drain(4, 3, 3), [Kind.FORWARD]))
    assert strs(plan.backward) == strs(phase(fill_drain(4, 3, 3), [Kind.RECOMPUTE, Kind.BACKWARD]))
    assert plan.inline_order == ()  # CPU: every partition on its worker
    model(torch.randn(8, 4)).sum().backward()
    assert model._pipeline.plan(4, 3) is plan
