"""GPipe's autograd function: the parameters are its inputs, so torch.autograd.grad, parameter hooks and
DataParallel over GPipe work as on the plain module; its outputs require grad exactly when the plain module's do;
a double backward is a clear error."""
import copy
from typing import List

import pytest
import torch
from torch import Tensor, nn

from tests.models import cpu_gpipe, grads_of, mlp, remember_and_recall
from torchpipe import DataParallel


def test_autograd_grad_with_respect_to_parameters() -> None:
    # It failed: "appears to not have been used in the graph"; the parameters were not inputs of the pipeline.
    model = mlp(2, 4)
    plain = copy.deepcopy(model)
    piped = cpu_gpipe(model, [2, 2], chunks=2)
    x = torch.randn(4, 4)
    got = torch.autograd.grad(piped(x).pow(2).sum(), list(piped.parameters()))
    want = torch.autograd.grad(plain(x).pow(2).sum(), list(plain.parameters()))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    assert all(p.grad is None for p in piped.parameters())
    some = torch.autograd.grad(piped(x).sum(), [piped[2].weight])  # only what was asked
    assert some[0].shape == (4, 4) and piped[0].weight.grad is None


def test_autograd_grad_with_respect_to_the_input_writes_no_parameter_grad() -> None:
    # torch.autograd.grad with respect to the input alone writes no parameter's .grad, as on the plain module.
    piped = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    x = torch.randn(4, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(piped(x).sum(), x)
    assert gx.shape == x.shape
    assert all(p.grad is None for p in piped.parameters())


def test_parameter_hooks_run_once_on_the_whole_gradient() -> None:
    # A parameter's hook runs once a backward, on the gradient summed over micro-batches, and what it returns
    # is what accumulates, as on the plain module.
    model = mlp(2, 4)
    plain = copy.deepcopy(model)
    piped = cpu_gpipe(model, [2, 2], chunks=4)
    seen: List[Tensor] = []
    piped[0].weight.register_hook(lambda g: seen.append(g) or g * 2)  # type: ignore[func-returns-value]
    plain[0].weight.register_hook(lambda g: g * 2)
    x = torch.randn(8, 4)
    piped(x).sum().backward()
    plain(x).sum().backward()
    assert len(seen) == 1
    assert torch.allclose(piped[0].weight.grad, plain[0].weight.grad, atol=1e-6)


def test_data_parallel_over_gpipe_trains() -> None:
    # DataParallel(GPipe(...)) trained nothing, silently.
    model = mlp(2, 4)
    plain = copy.deepcopy(model)
    wrapped = DataParallel(cpu_gpipe(model, [2, 2], chunks=2), ["cpu", "cpu"])
    x = torch.randn(8, 4)
    wrapped(x).sum().backward()
    plain(x).sum().backward()
    for got, want in zip(grads_of(model), grads_of(plain)):
        assert torch.allclose(got, want, atol=1e-6)


def test_double_backward_is_a_clear_error() -> None:
    # A gradient penalty (create_graph=True) failed with a message about retain_graph.
    piped = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward through a GPipe is not supported"):
        torch.autograd.grad(piped(x).sum(), x, create_graph=True)


def test_output_requires_grad_exactly_when_the_plain_modules_does() -> None:
    # A frozen model's output does not require grad, as the plain module's does not: a backward through it
    # fails as it would there.
    model = mlp(2, 4).requires_grad_(False)
    piped = cpu_gpipe(model, [2, 2], chunks=2)
    out = piped(torch.randn(4, 4))
    assert not out.requires_grad and not model(torch.randn(4, 4)).requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_layers_using_tensors_outside_the_module_get_their_gradients() -> None:
    # The skip guide's tuple example with its layers as globals: the output did not require grad.
    outside = nn.Linear(4, 4)

    class UsesOutside(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return outside(x)

    plain_outside = copy.deepcopy(outside)
    piped = cpu_gpipe(nn.Sequential(UsesOutside(), nn.ReLU(), UsesOutside()), [1, 2], chunks=2)
    x = torch.randn(4, 4)
    out = piped(x)
    assert out.requires_grad
    out.sum().backward()
    plain_outside(torch.relu(plain_outside(x))).sum().backward()
    assert torch.allclose(outside.weight.grad, plain_outside.weight.grad, atol=1e-6)


def test_tensors_kept_by_hand_across_partitions_give_right_gradients_every_time() -> None:
    # The user guide's current_microbatch() dict joins a later partition's graph to an earlier one's, so a
    # backward on one worker accumulates into another partition's parameters: setting those aside meanwhile
    # (to return them to the autograd engine) lost gradients now and then, depending on thread timing.
    remember, recall = remember_and_recall()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), remember, nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), recall)
    plain = copy.deepcopy(model)
    piped = cpu_gpipe(model, [2, 2, 2], chunks=4, checkpoint="never")
    x = torch.randn(8, 4)
    plain(x).pow(2).sum().backward()
    for _ in range(20):
        piped.zero_grad()
        piped(x).pow(2).sum().backward()
        for got, want in zip(grads_of(piped), grads_of(plain)):
            assert torch.allclose(got, want, atol=1e-6)
