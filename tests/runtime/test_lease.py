"""The gradient lease: one backward pass at a time sets a GPipe's parameter gradients aside, so one GPipe trains
from several threads and every gradient arrives."""
import copy
import threading
import time
from typing import Any, Callable, List, Set, Tuple

import pytest
import torch
from torch import Tensor, nn

from tests.models import cpu_gpipe, grads_of, mlp
from torchpipe import GPipe
from torchpipe.runtime.lease import process_lease


class _Gate(torch.autograd.Function):
    """Identity; its backward, which the engine runs after the GPipe's behind it, calls ``then``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, then: Callable[[], None]) -> Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        ctx.then()
        return grad, None


class _LeaseSpy:
    """Records every call of the process lease's ``take`` (each GPipe backward that would set gradients aside):
    the threads that entered it, and each call's thread and answer once it returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered: Set[int] = set()
        self.returned: List[Tuple[int, bool]] = []
        lease = process_lease()
        take = lease.take

        def spy(*, may_wait: bool, **named: Any) -> bool:
            me = threading.get_ident()
            self.entered.add(me)
            got = take(may_wait=may_wait, **named)
            self.returned.append((me, got))
            return got

        monkeypatch.setattr(lease, "take", spy)

    @property
    def answers(self) -> List[bool]:
        return [got for _, got in self.returned]


def _gpipe_and_plain(chunks: int) -> Tuple[GPipe, nn.Sequential]:
    torch.manual_seed(0)
    model = mlp(2, 4)
    plain = copy.deepcopy(model)
    return cpu_gpipe(model, [2, 2], chunks=chunks), plain


def _assert_both_steps_in_grads(piped: GPipe, plain: nn.Sequential, x1: Tensor, x2: Tensor) -> None:
    plain(x1).sum().backward()
    plain(x2).sum().backward()
    for got, want in zip(grads_of(piped), grads_of(plain)):
        assert torch.allclose(got, want, atol=1e-6)


def test_one_gpipe_trained_from_several_threads_gets_every_gradient() -> None:
    # A stage worker sets the parameters' .grad aside while it runs a micro-batch's backward (to return their
    # sums to the autograd engine). Another thread's engine, adding its step's sums into .grad at that moment,
    # added into the set-aside tensor or found .grad gone in the middle of its in-place add: 4 to 6% of such
    # runs failed ("Bad in-place call", "bump_version() on undefined tensor") or lost a gradient.
    import concurrent.futures

    for seed in range(12):
        torch.manual_seed(seed)
        model = mlp(3, 4)
        plain = copy.deepcopy(model)
        piped = cpu_gpipe(model, [2, 2, 2], chunks=4, checkpoint="except_last")
        inputs = [torch.randn(8, 4) for _ in range(8)]
        for x in inputs:
            plain(x).sum().backward()

        def train(x: Tensor, piped: GPipe = piped) -> None:
            piped(x).sum().backward()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(train, x) for x in inputs]:
                done.result(timeout=60)
        for got, want in zip(grads_of(piped), grads_of(plain)):
            assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.timeout(60)
def test_a_threads_backward_waits_until_another_threads_pass_has_its_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What keeps the threads apart: the pass that set a GPipe's gradients aside holds them until the engine has
    # finished it (here it is held up in a node behind the GPipe), and another thread's GPipe backward waits.
    piped, plain = _gpipe_and_plain(chunks=4)
    seen: List[Tensor] = []
    piped[0].weight.register_hook(lambda g: seen.append(g.clone()))
    x1, x2 = torch.randn(8, 4, requires_grad=True), torch.randn(8, 4)
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        assert go.wait(30)

    spy = _LeaseSpy(monkeypatch)
    first = threading.Thread(target=lambda: piped(_Gate.apply(x1, hold)).sum().backward())
    second = threading.Thread(target=lambda: piped(x2).sum().backward())
    first.start()
    assert held.wait(30)
    second.start()
    while second.ident is None or second.ident not in spy.entered:  # its forward done, its GPipe backward begun
        assert second.is_alive()
        time.sleep(0.01)
    time.sleep(0.3)
    assert second.ident not in dict(spy.returned), \
        "the second thread's backward went on while the first pass held the lease"
    go.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert not process_lease().held
    _assert_both_steps_in_grads(piped, plain, x1, x2)
    assert len(seen) == 2  # the hook ran once a pass, on the pass's whole gradient
    assert spy.answers == [True, True]  # both set their gradients aside


@pytest.mark.timeout(60)
def test_a_pass_that_fails_behind_the_gpipe_lets_the_next_one_run() -> None:
    # The engine runs no end-of-pass callback for a pass that failed: the lease then ends when the pass is freed,
    # else every later backward of the GPipe, in any thread, would wait for it forever.
    piped = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    x = torch.randn(4, 4, requires_grad=True)

    def fail() -> None:
        raise ValueError("a node behind the GPipe failed")

    with pytest.raises(ValueError, match="behind the GPipe"):
        piped(_Gate.apply(x, fail)).sum().backward()
    assert not process_lease().held
    other = threading.Thread(target=lambda: piped(torch.randn(4, 4)).sum().backward())
    other.start()
    other.join(30)
    assert not other.is_alive()


@pytest.mark.timeout(60)
def test_a_backward_nested_in_a_pass_that_holds_the_gradients_does_not_wait_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reentrant checkpoint runs its backward as a pass nested in the caller's, on the same thread: waiting
    # there for the outer pass, which already set the GPipe's gradients aside, would wait forever. It
    # accumulates into .grad directly instead.
    from torch.utils.checkpoint import checkpoint

    piped, plain = _gpipe_and_plain(chunks=2)
    x1, x2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    spy = _LeaseSpy(monkeypatch)
    nested = checkpoint(piped, x1, use_reentrant=True)
    outer = piped(x2)  # made later, so the engine runs its backward first
    (nested.sum() + outer.sum()).backward()
    assert spy.answers == [True, False]
    _assert_both_steps_in_grads(piped, plain, x1, x2)
