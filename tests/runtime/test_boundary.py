"""Stage boundaries: the leaves a stage starts from, an in-place first layer at a partition cut, which stages take
their leaves as they are, and the caller's input changed in place before the backward."""
import copy
from typing import Any, Callable, Tuple

import pytest
import torch
from torch import Tensor, nn

import torchpipe
from tests.models import cpu_gpipe, grads_of


class MulInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("first", [
    lambda: nn.LeakyReLU(0.1, inplace=True), lambda: nn.ELU(inplace=True), MulInPlace,
])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_an_in_place_layer_at_a_partition_cut_gets_right_gradients(
    first: Callable[[], nn.Module], checkpoint: str
) -> None:
    # An in-place first layer of a checkpointed partition: the checkpointed forward ran on the saved input itself,
    # so the recomputation started from modified data: outputs right, parameter gradients wrong, and the user's
    # input modified twice.
    torch.manual_seed(0)
    model = nn.Sequential(first(), nn.Linear(4, 4), nn.Linear(4, 4), first(), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    piped = cpu_gpipe(model, [3, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    x_plain = x.clone()
    out = piped(x)
    out.sum().backward()
    expected = plain(x_plain)
    expected.sum().backward()
    assert torch.allclose(out, expected)
    # The input was modified exactly once, as by the plain module. Not bit for bit: the in-place layer ran on
    # 2-row micro-batches here and on the 6-row batch there, and vectorised kernels (AVX2) round those
    # differently. A second application (ELU of ELU) would be far outside the tolerance.
    assert torch.allclose(x, x_plain, rtol=1e-6, atol=1e-7), "the input was modified a different number of times"
    for got, want in zip(grads_of(piped), grads_of(plain)):
        assert torch.allclose(got, want, atol=1e-6)


class DoubleInPlace(nn.Linear):
    """A Linear whose own forward changes its input in place first."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.mul_(2))


def _double_input(module: nn.Module, args: Tuple[Tensor, ...]) -> None:
    args[0].mul_(2)


def _global_hook() -> Any:
    def hook(module: nn.Module, args: Tuple[Any, ...]) -> None:
        if isinstance(module, nn.Linear) and module.in_features == 3:  # the second partition's first layer
            _double_input(module, args)

    return nn.modules.module.register_module_forward_pre_hook(hook)


@pytest.mark.parametrize("how", ["layer hook", "global hook", "subclass"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_stage_whose_first_layer_only_reads_its_input_still_lets_a_hook_change_it_in_place(
    how: str, checkpoint: str
) -> None:
    # Story: the alias that lets a stage change its input in place (the input is a leaf, which autograd would
    # not let change) cost an autograd function in Python per micro-batch and stage, forward and backward:
    # 15% of a tiny model's one-process step. A stage that starts with a Linear (or a convolution, or a norm
    # other than batch norm) hands its input to that layer alone, which only reads it: it now takes the leaves
    # as they are. Anything that may still change the input keeps the alias: a hook on that layer or on every
    # module, or a subclass with a forward of its own. Without it, each of these raised "a leaf Variable that
    # requires grad is being used in an in-place operation", where the plain module works.
    torch.manual_seed(0)
    second: nn.Module = DoubleInPlace(3, 4) if how == "subclass" else nn.Linear(3, 4)
    # The first partition ends with a Linear, which keeps its input for its backward, not its output.
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3), second, nn.Tanh(), nn.Linear(4, 2))
    if how == "layer hook":
        second.register_forward_pre_hook(_double_input)
    plain = copy.deepcopy(model)
    piped = cpu_gpipe(model, [3, 3], chunks=3, checkpoint=checkpoint)
    pipeline = torchpipe.Pipeline(copy.deepcopy(model), [3, 3], chunks=3, devices=["cpu", "cpu"], checkpoint=checkpoint,
                                  loss_fn=lambda out: out.pow(2).sum(), loss_reduction="sum")
    x = torch.randn(6, 4)
    handle = _global_hook() if how == "global hook" else None
    try:
        expected = plain(x)
        expected.pow(2).sum().backward()
        out = piped(x)
        out.pow(2).sum().backward()
        loss = pipeline.step(x)
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(loss, expected.pow(2).sum())
    for got, want in zip(grads_of(piped), grads_of(plain)):
        torch.testing.assert_close(got, want)
    for got, want in zip(grads_of(pipeline), grads_of(plain)):
        torch.testing.assert_close(got, want)


def test_which_stages_take_their_leaves_as_they_are() -> None:
    # takes_leaves decides which stages skip the alias (see the test above): only a stage whose first layer
    # reads its input and hands on none of it, with no hook and no forward of its own that could change it.
    from torchpipe.runtime.boundary import takes_leaves

    assert takes_leaves(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    assert takes_leaves(nn.Sequential(nn.Conv2d(1, 1, 1))) and takes_leaves(nn.Sequential(nn.LayerNorm(2)))
    assert not takes_leaves(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2)))  # changes it in place
    assert not takes_leaves(nn.Sequential(nn.Identity(), nn.ReLU(inplace=True)))  # hands it on as it is
    assert not takes_leaves(nn.Sequential(nn.Flatten(), nn.ReLU(inplace=True)))  # hands on a view of it
    assert not takes_leaves(nn.Sequential(DoubleInPlace(2, 2)))
    assert not takes_leaves(nn.Sequential()) and not takes_leaves(None)

    class Stage(nn.Sequential):  # a wrapped stage (FSDP2's is a subclass with hooks): its forward may differ
        pass

    assert not takes_leaves(Stage(nn.Linear(2, 2)))
    hooked = nn.Sequential(nn.Linear(2, 2))
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert not takes_leaves(hooked)
    backward_hooked = nn.Sequential(nn.Linear(2, 2))
    backward_hooked[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    assert not takes_leaves(backward_hooked)
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert not takes_leaves(nn.Sequential(nn.Linear(2, 2)))
    finally:
        handle.remove()
    assert takes_leaves(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_an_input_modified_before_backward_is_detected(checkpoint: str) -> None:
    # The plain module raises "modified by an inplace operation"; GPipe recomputed silently from the new values.
    model = cpu_gpipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2, checkpoint=checkpoint)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for module in (plain, model):
        x = torch.randn(4, 4)
        out = module(x)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
