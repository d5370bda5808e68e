"""pipe.memory(): the bytes each (stage, micro-batch) holds from its forward to its backward, counted on the first
training step, and the predicted peak of the schedule (see [Note: held bytes])."""
import copy

import pytest
import torch
from torch import nn

from tests.models import grads_of
from torchpipe import Pipeline

ROWS, CHUNKS = 4, 4  # rows per micro-batch


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))


def pipe_of(**kwargs: object) -> Pipeline:
    return Pipeline(model(), [2, 1], chunks=CHUNKS, loss_fn=lambda out: out.sum(), loss_reduction="sum",
                    devices=["cpu", "cpu"],
                    **kwargs)  # type: ignore[arg-type]


def test_before_the_first_step_nothing_is_measured() -> None:
    report = pipe_of().memory()
    assert not report.measured and report.predicted_peak == {}
    assert "nothing measured yet" in str(report) and "first training step" in str(report)


@pytest.mark.parametrize("schedule, held_at_once", [("gpipe", CHUNKS), ("1f1b", 2)])
def test_the_bytes_are_what_autograd_keeps(schedule: str, held_at_once: int) -> None:
    pipe = pipe_of(schedule=schedule)
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    # Stage 0 keeps its input (Linear saves it) and Tanh's output (Tanh saves it), not the first Linear's output;
    # stage 1 its input (the Linear saves it) and its loss, a float: out.sum() saves nothing.
    first, second = 4 * ROWS * (16 + 64), 4 * ROWS * 64 + 4
    assert report.held == {0: (first,) * CHUNKS, 1: (second,) * CHUNKS}
    assert report.recomputed == {0: (0,) * CHUNKS, 1: (0,) * CHUNKS}
    assert report.predicted_peak == {0: held_at_once * first, 1: (CHUNKS if schedule == "gpipe" else 1) * second}
    assert f"predicted peak of worker 0: {held_at_once * first} bytes" in str(report)


def test_a_checkpointed_micro_batch_holds_its_input_and_its_recomputation_the_rest() -> None:
    pipe = pipe_of(schedule="gpipe", checkpoint="always")
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    assert report.held[0] == (4 * ROWS * 16,) * CHUNKS  # the copy of its input
    assert report.recomputed[0] == (4 * ROWS * 64,) * CHUNKS  # Tanh's output, while recomputed
    # GPipe: every input copy at once, and one recomputed graph.
    assert report.predicted_peak[0] == CHUNKS * 4 * ROWS * 16 + 4 * ROWS * 64


def test_selective_holds_the_matmul_outputs_too() -> None:
    pipe = pipe_of(schedule="gpipe", checkpoint="always", recompute="selective")
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    # Its input's copy and the kept Linear output; the recomputation adds Tanh's output.
    assert report.held[0] == (4 * ROWS * (16 + 64),) * CHUNKS
    assert report.recomputed[0] == (4 * ROWS * 64,) * CHUNKS


def test_measuring_changes_neither_loss_nor_gradients_and_works_with_compiled_layers() -> None:
    x = torch.randn(ROWS * CHUNKS, 16)
    plain = model()
    plain(x).sum().backward()
    pipe = pipe_of(compile={"backend": "aot_eager"})
    loss = pipe.step(x)
    torch.testing.assert_close(loss, plain(x).sum().detach())
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b)
    assert pipe.memory().held[0][0] > 0


def test_the_first_training_step_is_measured_and_another_number_of_micro_batches_again() -> None:
    pipe = pipe_of()
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    with torch.no_grad():
        pipe.step(torch.randn(7, 16))  # no backward: nothing measured
    pipe.step(torch.randn(2 * ROWS * CHUNKS, 16))  # the measured step's shape: kept as it was
    assert pipe.memory().held[0] == (4 * ROWS * (16 + 64),) * CHUNKS
    pipe.step(torch.randn(2, 16))  # two micro-batches: measured again
    assert pipe.memory().held[0] == (4 * (16 + 64),) * 2
    copy.deepcopy(pipe)  # a measured pipeline copies
