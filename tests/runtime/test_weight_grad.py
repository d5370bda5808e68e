"""The split backward of zero-bubble schedules: I computes the inputs' gradients, W the weights', once each."""
from typing import Any, List, Tuple

import torch
from torch import Tensor, nn

from torchpipe.runtime.weight_grad import backward_input, backward_weight


class Count(torch.autograd.Function):
    """Identity that counts its backward calls (on the path to the inputs)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        Count.calls += 1
        return grad


def reference(build: Any, x: Tensor) -> Tuple[List[Tensor], Tensor]:
    """Parameter gradients and input gradient of one whole backward."""
    leaf = x.detach().requires_grad_()
    module, out = build(leaf)
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    return [p.grad.clone() for p in module.parameters()], leaf.grad


def split(build: Any, x: Tensor) -> Tuple[List[Tensor], Tensor, List[Any]]:
    leaf = x.detach().requires_grad_()
    module, out = build(leaf)
    (gx,), state = backward_input(out, [torch.ones_like(o) for o in out], [leaf])
    after_input = [p.grad for p in module.parameters()]
    assert state is not None
    backward_weight(state)
    return [p.grad.clone() for p in module.parameters()], gx, after_input


def test_a_chain_of_linears() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))

    def build(x: Tensor) -> Any:
        layers.zero_grad(set_to_none=True)
        return layers, [layers(x)]

    x = torch.randn(6, 4)
    want, want_x = reference(build, x)
    got, got_x, after_input = split(build, x)
    assert all(g is None for g in after_input), "I computed weight gradients"
    assert torch.allclose(got_x, want_x)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_w_does_not_run_the_input_path_again() -> None:
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    leaf = torch.randn(3, 4, requires_grad=True)
    out = layers[2](Count.apply(layers[1](layers[0](leaf))))
    Count.calls = 0
    _, state = backward_input([out], [torch.ones_like(out)], [leaf])
    assert Count.calls == 1
    assert state is not None
    backward_weight(state)
    assert Count.calls == 1, "W ran the input-gradient path again"
    assert all(p.grad is not None for p in layers.parameters())


def test_a_weight_used_twice_on_the_input_path_is_counted_once() -> None:
    weight = nn.Parameter(torch.randn(4))
    holder = nn.Module()
    holder.weight = weight

    def build(x: Tensor) -> Any:
        holder.zero_grad(set_to_none=True)
        return holder, [(x * weight) * weight + weight.sum()]

    x = torch.randn(3, 4)
    want, want_x = reference(build, x)
    got, got_x, _ = split(build, x)
    assert torch.allclose(got_x, want_x) and torch.allclose(got[0], want[0])


def test_an_output_that_depends_on_weights_only() -> None:
    lin = nn.Linear(4, 4)

    def build(x: Tensor) -> Any:
        lin.zero_grad(set_to_none=True)
        return lin, [lin(x), lin.weight * 3]

    x = torch.randn(2, 4)
    want, want_x = reference(build, x)
    got, got_x, _ = split(build, x)
    assert torch.allclose(got_x, want_x) and all(torch.allclose(a, b) for a, b in zip(got, want))


def test_without_inputs_needing_grad_w_runs_the_whole_backward() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    out = lin(x)
    (gx,), state = backward_input([out], [torch.ones_like(out)], [x])
    assert gx is None and lin.weight.grad is None and state is not None
    backward_weight(state)
    expected = torch.ones(2, 4).t() @ x
    assert torch.allclose(lin.weight.grad, expected)


def test_a_tensor_from_outside_the_module_gets_its_gradient_in_w() -> None:
    outside = torch.randn(4, requires_grad=True)
    leaf = torch.randn(3, 4, requires_grad=True)
    out = (leaf * outside).tanh()
    _, state = backward_input([out], [torch.ones_like(out)], [leaf])
    assert outside.grad is None and state is not None
    backward_weight(state)
    expected = ((1 - out.detach() ** 2) * leaf.detach()).sum(0)
    assert torch.allclose(outside.grad, expected)


def test_w_runs_the_engine_without_autograd_backwards_python_checks(monkeypatch: Any) -> None:
    """W makes one engine run per parameter group (a chain of 8 linears: 8 runs). Its seeds are the gradients the
    engine itself delivered in I, so where PyTorch exposes the engine's entry (2.3 and later) W calls it directly,
    without ``torch.autograd.backward``'s Python checks (measured with the order of the next test in
    benchmarks/experiments/split_backward.py). Both ways give the plain backward's gradients, and on this PyTorch
    the direct one is taken."""
    from torchpipe.runtime import weight_grad

    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(6, 6), nn.ReLU())])

    def build(x: Tensor) -> Any:
        layers.zero_grad(set_to_none=True)
        return layers, [layers(x)]

    x = torch.randn(5, 6)
    want, want_x = reference(build, x)
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.4":
        assert weight_grad._engine_run_backward is not None, "PyTorch moved the engine's entry: W lost its fast path"

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("W went through torch.autograd.backward")

    with monkeypatch.context() as patch:
        patch.setattr(torch.autograd, "backward", refuse)
        got, got_x, _ = split(build, x)
    assert torch.allclose(got_x, want_x) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))

    monkeypatch.setattr(weight_grad, "_engine_run_backward", None)  # an older PyTorch: the public call
    got, got_x, _ = split(build, x)
    assert torch.allclose(got_x, want_x) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_w_runs_the_groups_newest_capture_first() -> None:
    """I reaches the first layer's intermediate last, so its gradient and input are the ones still in the CPU's
    caches when W starts: W begins there and climbs (measured with the previous test's direct runs in
    benchmarks/experiments/split_backward.py). The order changes no sum: each group has its own parameters."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.ReLU())])
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    order: List[int] = []
    handles = [lin.weight.register_post_accumulate_grad_hook(lambda p, k=k: order.append(k))
               for k, lin in enumerate(linears)]

    def build(x: Tensor) -> Any:
        layers.zero_grad(set_to_none=True)
        return layers, [layers(x)]

    x = torch.randn(5, 6)
    want, want_x = reference(build, x)
    assert order == [3, 2, 1, 0]  # the one backward: last layer first
    order.clear()
    got, got_x, _ = split(build, x)
    for handle in handles:
        handle.remove()
    assert order == [0, 1, 2, 3]
    assert torch.allclose(got_x, want_x) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
