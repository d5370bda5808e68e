"""Tests of the pipeline timeline (torchpipe/trace.py): what is recorded, its order, and its exports."""
import json
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest
import torch
from torch import nn

import torchpipe
from torchpipe import trace
from torchpipe.checkpoint import checkpoint_stop
from torchpipe.schedule import gpipe, parse, with_recomputation

CHUNKS = 4


def make_pipe(checkpoint: str = "except_last") -> torchpipe.GPipe:
    # Wide enough that every task takes a few milliseconds: the order checks compare clock readings.
    layers: List[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(384, 384), nn.ReLU()]
    return torchpipe.GPipe(nn.Sequential(*layers), [4, 4], devices=["cpu", "cpu"], chunks=CHUNKS,
                           checkpoint=checkpoint)


def train_step(pipe: torchpipe.GPipe) -> None:
    pipe(torch.randn(256, 384)).sum().backward()


@pytest.fixture(scope="module")
def recorded() -> Iterator[Tuple[trace.Timeline, torchpipe.GPipe]]:
    pipe = make_pipe()
    train_step(pipe)  # warm up the workers
    with trace.record_timeline() as timeline:
        train_step(pipe)
    yield timeline, pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_scheduled_task_is_recorded_once(checkpoint: str) -> None:
    pipe = make_pipe(checkpoint)
    with trace.record_timeline() as timeline:
        train_step(pipe)
    stop = checkpoint_stop(checkpoint, CHUNKS, True)
    schedule = with_recomputation(gpipe(CHUNKS, 2), lambda s, i: i < stop)
    expected = {(a.stage, a.kind.label, a.microbatch) for a in schedule.actions()}
    recorded = [(s.partition, s.kind, s.microbatch) for s in timeline]
    assert sorted(recorded) == sorted(expected)
    assert len(recorded) == len(set(recorded))
    assert all(s.end >= s.start >= timeline.started for s in timeline)


def test_tasks_on_one_partition_do_not_overlap(recorded: Tuple[trace.Timeline, torchpipe.GPipe]) -> None:
    timeline, _ = recorded
    for j in range(2):
        row = [s for s in timeline.tasks() if s.partition == j]
        for before, after in zip(row, row[1:]):
            assert after.start >= before.end, (before, after)


# The runner marks when a task's input arrived (trace.mark_start) and when its output leaves
# (trace.mark_end), so a task that takes a hand-over starts after the task that made it ended.
def test_forward_starts_after_previous_partition_and_backward_after_next(
    recorded: Tuple[trace.Timeline, torchpipe.GPipe],
) -> None:
    timeline, _ = recorded
    tasks = {(s.kind, s.partition, s.microbatch): s for s in timeline.tasks()}
    for i in range(CHUNKS):
        assert tasks["forward", 1, i].start >= tasks["forward", 0, i].end
        assert tasks["backward", 0, i].start >= tasks["backward", 1, i].end


def test_fill_drain_order(recorded: Tuple[trace.Timeline, torchpipe.GPipe]) -> None:
    timeline, _ = recorded
    # Each partition runs its forwards in micro-batch order, then its backwards in reverse.
    for j in range(2):
        row = [s for s in timeline.tasks() if s.partition == j]
        forwards = [s.microbatch for s in row if s.kind == "forward"]
        backwards = [s.microbatch for s in row if s.kind == "backward"]
        assert forwards == list(range(CHUNKS))
        assert backwards == list(reversed(range(CHUNKS)))
        assert [s.kind for s in row[:CHUNKS]] == ["forward"] * CHUNKS
    first = {(s.kind, s.partition, s.microbatch): s for s in timeline}
    for i in range(CHUNKS):
        # A forward cannot end before the one it took its input from began, nor a backward.
        assert first["forward", 1, i].end >= first["forward", 0, i].start
        assert first["backward", 0, i].end >= first["backward", 1, i].start


def test_nothing_is_recorded_outside_the_block() -> None:
    pipe = make_pipe()
    assert not trace.active()
    train_step(pipe)
    with trace.record_timeline() as timeline:
        assert trace.active()
        train_step(pipe)
        count = len(timeline)
    assert not trace.active()
    train_step(pipe)
    assert len(timeline) == count > 0


def test_span_is_a_shared_no_op_when_off() -> None:
    assert trace.span("forward", 0, 0) is trace.span("backward", 1, 2)
    with trace.span("forward", 0, 0):
        trace.mark_start()
        trace.mark_end()


def test_blocks_nest_and_each_gets_its_tasks() -> None:
    pipe = make_pipe()
    with trace.record_timeline() as outer:
        train_step(pipe)
        with trace.record_timeline() as inner:
            train_step(pipe)
    assert len(outer) == 2 * len(inner) > 0


def test_spans_from_other_threads_are_recorded() -> None:
    def task() -> None:
        with trace.span("copy", 1, 0):
            pass

    with trace.record_timeline() as timeline:
        with trace.span("forward", 0, 3):
            pass
        thread = threading.Thread(target=task, name="other")
        thread.start()
        thread.join()
    assert sorted((s.label, s.thread) for s in timeline) == [("0F3", threading.current_thread().name), ("1C0", "other")]


def test_mark_start_and_mark_end_narrow_the_span() -> None:
    with trace.record_timeline() as timeline:
        with trace.span("backward", 1, 2):
            time.sleep(0.01)  # waiting for the input
            trace.mark_start()
            marked_start = time.perf_counter()
            trace.mark_end()
            marked_end = time.perf_counter()
            time.sleep(0.01)  # after the hand-over
    (span,) = timeline
    assert span.start <= marked_start <= span.start + 0.005
    assert span.end <= marked_end
    assert span.duration < 0.005
    assert span.label == "1B2"


def test_a_failing_task_is_still_recorded() -> None:
    with trace.record_timeline() as timeline:
        with pytest.raises(RuntimeError, match="boom"):
            with trace.span("forward", 0, 1):
                raise RuntimeError("boom")
    assert [s.label for s in timeline] == ["0F1"]


def test_tasks_start_when_the_input_was_there() -> None:
    timeline = trace.Timeline(started=0.0)
    timeline.add(trace.Span("forward", 0, 0, 0.0, 1.0, "a"))
    timeline.add(trace.Span("forward", 1, 0, 0.0, 1.5, "b"))  # waited for 0F0 from 0.0 to 1.0
    timeline.add(trace.Span("backward", 1, 0, 2.0, 3.0, "b"))
    timeline.add(trace.Span("backward", 0, 0, 1.6, 3.5, "a"))  # waited for 1B0
    drawn = {s.label: (s.start, s.end) for s in timeline.tasks()}
    assert drawn == {"0F0": (0.0, 1.0), "1F0": (1.0, 1.5), "1B0": (2.0, 3.0), "0B0": (3.0, 3.5)}
    assert timeline.spans[1].start == 0.0  # what was recorded is kept


def test_chrome_trace_is_valid_json_with_one_row_per_partition(
    recorded: Tuple[trace.Timeline, torchpipe.GPipe], tmp_path: Path
) -> None:
    timeline, _ = recorded
    path = tmp_path / "sub" / "timeline.json"
    timeline.save_chrome_trace(path)
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(timeline.to_chrome_trace()))
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(timeline)
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert rows == {0: "partition 0", 1: "partition 1"}
    seen: Set[Tuple[int, str, int]] = set()
    for event in complete:
        action = parse(event["name"])
        assert event["tid"] == action.partition == event["args"]["partition"]
        assert event["cat"] == action.kind.label == event["args"]["kind"]
        assert event["args"]["microbatch"] == action.microbatch
        assert event["ts"] >= 0 and event["dur"] >= 0 and event["pid"] == 0
        seen.add((action.partition, event["cat"], action.microbatch))
    assert len(seen) == len(complete)


def test_png_is_written(recorded: Tuple[trace.Timeline, torchpipe.GPipe], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    timeline, _ = recorded
    path = tmp_path / "out" / "timeline.png"
    timeline.save_png(path, title="a test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_png_of_an_empty_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with trace.record_timeline() as timeline:
        pass
    timeline.save_png(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").exists()


def test_png_without_matplotlib_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ["matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.patches"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        trace.Timeline().save_png(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_timelines_of_several_processes_merge_on_one_clock() -> None:
    # Two ranks' timelines, begun at different wall times: merged, each span keeps its rank and lands where its
    # wall time says, and the Chrome trace has a process per rank with a row per stage.
    first = trace.Timeline([trace.Span("forward", 0, 0, 10.0, 10.5, "MainThread")], started=10.0, wall=1000.0)
    second = trace.Timeline([trace.Span("forward", 1, 0, 50.25, 50.75, "MainThread")], started=50.0, wall=1000.5)
    merged = trace.Timeline.merge([(0, first), (1, second)])
    spans = sorted(merged.spans, key=lambda s: s.rank or 0)
    assert [(s.rank, s.partition) for s in spans] == [(0, 0), (1, 1)]
    assert spans[1].start == pytest.approx(10.75) and spans[1].end == pytest.approx(11.25)
    assert merged.rows() == [(0, 0), (1, 1)]
    events = merged.to_chrome_trace()["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] in ("process_name", "thread_name")}
    assert {(0, "rank 0"), (1, "rank 1"), (0, "stage 0"), (1, "stage 1")} <= names
    again = trace.Timeline.from_json(merged.to_json())
    assert again.spans == merged.spans and again.wall == merged.wall
