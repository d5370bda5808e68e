"""Pipelines inside pipelines: a GPipe nested in a GPipe (at any depth, in a DataParallel replica, in a Pipeline's
stage), and what happens to a wait that would never end.

The story (issue 33): a GPipe whose Sequential held another GPipe hung for ever in ``backward()``. The outer
stage's worker ran the inner GPipe's backward as a pass of its own, which waited for the gradient lease (see
[Note: gradient lease]) that the outer pass held, while the outer pass waited for that worker. Nothing broke the
wait, not even pytest-timeout's signal: the main thread sat inside the autograd engine. Now a pass that works
for the lease's holder takes part in its lease, and a wait that would close a circle raises (see [Note: waits]).
"""
import copy
import threading
import time
from typing import Any, List

import pytest
import torch
from torch import Tensor, nn

from torchpipe import DataParallel, GPipe, Pipeline, waits
from torchpipe.runtime.lease import process_lease

CHECKPOINTS = ["never", "except_last", "always"]


def cpu_gpipe(module: nn.Sequential, balance: List[int], **kwargs: Any) -> GPipe:
    return GPipe(module, balance, devices=["cpu"] * len(balance), **kwargs)


def layers(count: int, width: int = 4) -> List[nn.Module]:
    """``count`` layers: linear, tanh, linear, ..."""
    return [nn.Tanh() if k % 2 else nn.Linear(width, width) for k in range(count)]


def assert_same_gradients(got: nn.Module, want: nn.Module) -> None:
    got_grads = [p.grad for p in got.parameters()]
    want_grads = [p.grad for p in want.parameters()]
    assert len(got_grads) == len(want_grads)
    for k, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert g is not None and w is not None, f"parameter {k}: a gradient is missing"
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), f"parameter {k}: {g} != {w}"


def nested(depth: int, checkpoint: str) -> nn.Sequential:
    """A Sequential whose first layer is a GPipe whose first layer is a GPipe ... ``depth`` levels of GPipe; the
    plain twin is the same layers, flattened into nested plain Sequentials."""
    module: nn.Module = nn.Sequential(*layers(3))
    for _ in range(depth):
        module = cpu_gpipe(nn.Sequential(module, *layers(3)), [1, 3], chunks=2, checkpoint=checkpoint)
    return nn.Sequential(module)


def plain_twin(module: nn.Module) -> nn.Module:
    """The same computation without pipelines: each GPipe replaced by a plain Sequential of its layers."""
    if isinstance(module, GPipe):
        return nn.Sequential(*(plain_twin(layer) for partition in module.partitions for layer in partition))
    if isinstance(module, nn.Sequential):
        return nn.Sequential(*(plain_twin(layer) for layer in module))
    return copy.deepcopy(module)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("depth", [2, 3])
def test_a_gpipe_nested_in_gpipes_returns_the_plain_gradients(depth: int, checkpoint: str) -> None:
    piped = nested(depth, checkpoint)
    plain = plain_twin(piped)
    x = torch.randn(4, 4, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out = piped(x)
    want = plain(x_plain)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    want.square().sum().backward()
    assert_same_gradients(piped, plain)
    assert x.grad is not None and x_plain.grad is not None
    assert torch.allclose(x.grad, x_plain.grad, rtol=1e-5, atol=1e-6)
    assert not process_lease().held


@pytest.mark.timeout(120)
def test_a_nested_gpipe_trains_step_after_step() -> None:
    piped = nested(2, "except_last")
    plain = plain_twin(piped)
    sgd, sgd_plain = torch.optim.SGD(piped.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(6, 4)
        for model, optimizer in ((piped, sgd), (plain, sgd_plain)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for got, want in zip(piped.parameters(), plain.parameters()):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_gpipe_in_a_data_parallel_in_a_gpipe_returns_the_plain_gradients() -> None:
    inner = cpu_gpipe(nn.Sequential(*layers(3)), [1, 2], chunks=2)
    replicated = DataParallel(inner, [torch.device("cpu"), torch.device("cpu")])
    outer = cpu_gpipe(nn.Sequential(replicated, *layers(3)), [1, 3], chunks=2)
    plain = nn.Sequential(plain_twin(inner), *(plain_twin(layer) for layer in list(outer)[1:]))
    x = torch.randn(8, 4)
    outer(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_same_gradients(outer, plain)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_gpipe_in_a_pipelines_stage_returns_the_plain_loss_and_gradients(schedule: str) -> None:
    inner = cpu_gpipe(nn.Sequential(*layers(3)), [2, 1], chunks=2, checkpoint="always")
    pipe = Pipeline(nn.Sequential(*layers(2), inner, *layers(2)), [3, 2], chunks=2, schedule=schedule,
                    loss_fn=lambda out, y: (out - y).square().mean())
    plain = plain_twin(nn.Sequential(*pipe.stages[0], *pipe.stages[1]))  # type: ignore[misc]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.step(x, y)
    want = (plain(x) - y).square().mean()
    want.backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-5, atol=1e-6)
    assert_same_gradients(pipe, plain)


@pytest.mark.timeout(120)
def test_a_pipeline_inside_a_gpipe_runs_its_forward() -> None:
    # A Pipeline as a layer computes its forward alone (no graph: its documented behaviour): a frozen feature
    # extractor before the GPipe's trained layers.
    frozen = Pipeline(nn.Sequential(*layers(2)), [1, 1], chunks=2).requires_grad_(False)
    outer = cpu_gpipe(nn.Sequential(frozen, *layers(3)), [1, 3], chunks=2)
    plain = nn.Sequential(plain_twin(nn.Sequential(*frozen.stages[0], *frozen.stages[1])),  # type: ignore[misc]
                          *(plain_twin(layer) for layer in list(outer)[1:]))
    x = torch.randn(8, 4)
    out = outer(x)
    want = plain(x)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    want.sum().backward()
    assert_same_gradients(nn.ModuleList(list(outer)[1:]), nn.ModuleList(list(plain)[1:]))


# --- waits that would never end ----------------------------------------------------------------------------


class CallsBack(nn.Module):
    """Runs ``target`` (set after construction) on its input: a pipeline that reaches itself."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Any = None

    def forward(self, x: Tensor) -> Tensor:
        return x if self.target is None or x.size(0) < 2 else self.target(x[:1]).expand_as(x)


@pytest.mark.timeout(60)
def test_a_gpipe_used_inside_itself_raises_instead_of_hanging() -> None:
    loop = CallsBack()
    piped = cpu_gpipe(nn.Sequential(nn.Linear(4, 4), loop, nn.Linear(4, 4)), [2, 1], chunks=1)
    loop.__dict__["target"] = piped  # not a submodule: the module tree stays a tree
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a wait that would never end.*the running phase of GPipe\(balance="):
        piped(torch.randn(4, 4))
    assert time.monotonic() - started < 30
    loop.__dict__["target"] = None
    piped(torch.randn(4, 4)).sum().backward()  # the same GPipe works on the next call


@pytest.mark.timeout(60)
def test_a_nested_backward_that_would_wait_for_its_holder_raises_naming_both_gpipes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Were the nested pass not known to work for the outer one (the case of a thread torchpipe did not start),
    # its wait for the lease would be a wait for itself: it raises, naming the pipelines, instead of hanging.
    monkeypatch.setattr(waits, "behalf", lambda: ())
    piped = nested(2, "never")
    inner_label = piped[0][0]._runner.stages.label
    outer_label = piped[0]._runner.stages.label
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a wait that would never end") as raised:
        piped(torch.randn(4, 4)).sum().backward()
    assert time.monotonic() - started < 30
    message = str(raised.value)
    assert f"the gradient lease (for {inner_label}'s backward), held by the backward pass of {outer_label}" in message
    assert f"the workers of {outer_label}" in message
    assert not process_lease().held
    monkeypatch.undo()
    piped.zero_grad()
    piped(torch.randn(4, 4)).sum().backward()


def test_a_wait_for_itself_or_through_another_thread_raises() -> None:
    me = threading.current_thread()
    with pytest.raises(RuntimeError, match="would wait for the answer.*which needs itself"):
        with waits.waiting("the answer", [me]):
            pass
    # A circle of two: this thread waits for a helper thread, which then waits for this one.
    caught: List[BaseException] = []
    ready, done = threading.Event(), threading.Event()

    def helper() -> None:
        assert ready.wait(10)
        try:
            with waits.waiting("the main thread's result", [me]):
                pass
        except RuntimeError as exc:
            caught.append(exc)
        done.set()

    thread = threading.Thread(target=helper, name="helper")
    thread.start()
    with waits.waiting("the helper's result", [thread]):
        ready.set()
        assert done.wait(10)
    thread.join(10)
    assert len(caught) == 1
    assert "thread 'helper' would wait for the main thread's result" in str(caught[0])
    assert f"thread {me.name!r} waits for the helper's result" in str(caught[0])
    # Nothing is left said once the waits are over: the same waits, one after the other, are fine.
    with waits.waiting("the helper's result", [thread]):
        pass
