"""pipe.memory(): the bytes each (stage, micro-batch) holds from its forward to its backward, counted on the first
training step, and the predicted peak of the schedule (see [Note: held bytes])."""
import copy
import gc
import weakref
from typing import Tuple

import pytest
import torch
from torch import nn

from tests.models import grads_of
from torchpipe import Pipeline
from torchpipe.runtime.held import Temporaries, measuring_time
from torchpipe.schedule import Kind, simulate, zero_bubble

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


@pytest.mark.parametrize("schedule, held_at_second", [("gpipe", (CHUNKS - 1, CHUNKS - 1)), ("1f1b", (2, 1))])
def test_the_bytes_are_what_autograd_keeps(schedule: str, held_at_second: Tuple[int, int]) -> None:
    pipe = pipe_of(schedule=schedule)
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    # Stage 0 keeps its input (Linear saves it) and Tanh's output (Tanh saves it), not the first Linear's output;
    # stage 1 its input (the Linear saves it) and its loss, a float: out.sum() saves nothing.
    first, second = 4 * ROWS * (16 + 64), 4 * ROWS * 64 + 4
    assert report.held == {0: (first,) * CHUNKS, 1: (second,) * CHUNKS}
    assert report.recomputed == {0: (0,) * CHUNKS, 1: (0,) * CHUNKS}
    # The step made each stage's gradients (none existed before it): weights and biases, 4 bytes each.
    gradients = {0: 4 * (16 * 64 + 64), 1: 4 * (64 * 16 + 16)}
    assert report.gradients == gradients and report.buffers == {}  # one process: no receive posted ahead
    # What a backward makes on its way, the most at once: stage 0's Tanh's input gradient (ROWS x 64 floats), then
    # beside it the Linear's weight and bias gradients (its input needs none); stage 1's the Linear's input, weight
    # and bias gradients at once (the loss gradient expanded is a view of the one the backward starts from).
    temporaries = {0: 4 * (ROWS * 64 + 16 * 64 + 64), 1: 4 * (ROWS * 64 + 64 * 16 + 16)}
    assert report.temporaries == {s: (t,) * CHUNKS for s, t in temporaries.items()}
    # Both schedules reach their peak at a stage's second backward: the gradients its first one made (counted
    # among that one's temporaries while it ran), the pairs it still holds, what the second makes on its way.
    peak = {s: held_at_second[s] * (first, second)[s] + gradients[s] + temporaries[s] for s in (0, 1)}
    assert report.predicted_peak == peak
    assert f"predicted peak of worker 0: {peak[0]} bytes" in str(report)


def test_gradients_that_exist_before_the_measured_step_are_not_its_bytes() -> None:
    # Accumulation: the second of two steps adds into .grad, it makes nothing. Measured again for another
    # number of micro-batches without zero_grad, its report counts no gradients.
    pipe = pipe_of(schedule="1f1b")
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    assert pipe.memory().gradients[0] > 0
    pipe.step(torch.randn(2, 16))  # two micro-batches of one row
    assert pipe.memory().held[0] == (4 * (16 + 64),) * 2 and pipe.memory().gradients == {0: 0, 1: 0}
    pipe.zero_grad(set_to_none=True)
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    assert pipe.memory().gradients == {0: 4 * (16 * 64 + 64), 1: 4 * (64 * 16 + 16)}


def test_a_checkpointed_micro_batch_holds_its_input_and_its_recomputation_the_rest() -> None:
    pipe = pipe_of(schedule="gpipe", checkpoint="always")
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    assert report.held[0] == (4 * ROWS * 16,) * CHUNKS  # the copy of its input
    assert report.recomputed[0] == (4 * ROWS * 64,) * CHUNKS  # Tanh's output, while recomputed
    # GPipe: at its second backward, the other input copies, one recomputed graph, the gradients the first
    # backward made and what the second makes on its way.
    assert report.predicted_peak[0] == ((CHUNKS - 1) * 4 * ROWS * 16 + 4 * ROWS * 64 + report.gradients[0]
                                        + report.temporaries[0][1])


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


def test_a_split_backward_holds_the_gradients_its_weight_half_starts_from() -> None:
    # zero_bubble's I hands the input gradients back and keeps, until its W, the gradient at each weight's
    # operation: stage 0's first Linear's output gradient (ROWS x 64 floats); stage 1's is the loss's gradient,
    # one float expanded. simulate holds them from I to W (deferred=).
    pipe = pipe_of(schedule=zero_bubble(CHUNKS, 2))
    pipe.step(torch.randn(ROWS * CHUNKS, 16))
    report = pipe.memory()
    assert report.deferred == {0: (4 * ROWS * 64,) * CHUNKS, 1: (4,) * CHUNKS}
    assert "(+ 1024 from I to W)" in str(report)
    # Each half's temporaries while it runs, the larger counted: stage 1's I makes the Linear's input gradient
    # (ROWS x 64 floats), its W the weight and bias gradients (64 x 16 + 16 floats). Stage 0's input needs no
    # gradient, so its W runs the whole backward (as test_the_bytes_are_what_autograd_keeps counts it).
    assert report.temporaries == {0: (4 * (ROWS * 64 + 16 * 64 + 64),) * CHUNKS, 1: (4 * (64 * 16 + 16),) * CHUNKS}
    sizes, deferred = [report.held[0], report.held[1]], [report.deferred[0], report.deferred[1]]
    gradients = [report.gradients[0], report.gradients[1]]
    temporaries = [report.temporaries[0], report.temporaries[1]]
    expected = simulate(zero_bubble(CHUNKS, 2), {k: 1.0 for k in Kind}, sizes=sizes, deferred=deferred,
                        gradients=gradients, temporaries=temporaries).peak_bytes
    assert report.predicted_peak == {0: int(expected[0]), 1: int(expected[1])}
    without = simulate(zero_bubble(CHUNKS, 2), {k: 1.0 for k in Kind}, sizes=sizes, gradients=gradients,
                       temporaries=temporaries).peak_bytes
    assert expected[0] > without[0]  # the deferred gradients are part of worker 0's peak


def test_temporaries_leave_out_the_gradient_a_backward_starts_from_where_it_passes_on_unchanged() -> None:
    # out = x @ w + x: the sum's backward hands its gradient, as it is, to both branches; the matmul makes its
    # input's gradient (4 x 8 floats) and its weight's (8 x 8). The received gradient is counted elsewhere.
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = x @ w + x
    seed = torch.randn(4, 8)
    counted = Temporaries([out])
    counted.run([seed])
    out.backward(seed)
    counted.remove()
    assert counted.most == 4 * (4 * 8 + 8 * 8)
    assert measuring_time() > 0  # the hooks' own time, which a timed action leaves out


def test_hooks_left_on_a_graph_keep_nothing_alive() -> None:
    # A step that fails between a pair's I and its W leaves the counting hooks on its graph, after an I that ran
    # only the input's half: the graph and what it saved go once nothing else holds them.
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    saved = torch.tanh(x @ w)  # tanh saves its output
    out = saved * 2
    gone = weakref.ref(saved)
    counted = Temporaries([out])
    seed = torch.randn(4, 8)
    counted.run([seed])
    torch.autograd.grad(out, [x], seed, retain_graph=True)  # I: the weight's half not run
    assert counted.most == 4 * (4 * 8 + 4 * 8)  # tanh's input gradient, then x's; none left for w's half
    del saved, out
    gc.collect()
    assert gone() is None
