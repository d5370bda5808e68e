"""Pipelined ``as_sequential(module)``: outputs and every gradient equal the module's.

For every model, balance, checkpoint mode and chunks. Each pipeline is a
*runner*: a function that wraps the Sequential and returns a training step
(forward, loss, backward). A new pipeline (``torchpipe.Pipeline``) joins by
adding a runner to ``RUNNERS``.
"""
import copy
import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchpipe
from tests.sequential.models import Encoder, ResidualNet, TwoInTwoOut, UNet
from torchpipe.transfer import record_transfers

CHECKPOINTS = ["always", "except_last", "never"]

#: A training step: takes the input (a tensor or a tuple of tensors), runs forward, the loss and backward;
#: returns the output (or None when the pipeline does not hand it out) and the loss.
Step = Callable[[Any], Tuple[Optional[Any], Tensor]]
#: Wraps a Sequential for (balance, chunks, checkpoint) and returns its training step.
Runner = Callable[[nn.Sequential, List[int], int, str], Step]


def flat(output: Any) -> List[Tensor]:
    return [output] if isinstance(output, Tensor) else list(output)


def loss_of(output: Any) -> Tensor:
    """A loss that reaches every output element: the sum of squares."""
    return sum((t.float().pow(2).sum() for t in flat(output)), torch.zeros(()))


def gpipe(seq: nn.Sequential, balance: List[int], chunks: int, checkpoint: str) -> Step:
    model = torchpipe.GPipe(seq, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)

    def step(input: Any) -> Tuple[Optional[Any], Tensor]:
        output = model(input)
        loss = loss_of(output)
        loss.backward()
        return output, loss

    return step


def pipeline(schedule: str) -> Runner:
    """A ``torchpipe.Pipeline`` runner: the loss (the sum of squares) computed per micro-batch, summed."""

    def runner(seq: nn.Sequential, balance: List[int], chunks: int, checkpoint: str) -> Step:
        stages = len(balance)
        devices = ["cpu"] * (stages // 2) if schedule == "interleaved_1f1b" else None
        model = torchpipe.Pipeline(seq, balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                                   loss_fn=loss_of, loss_reduction="sum", devices=devices)

        def step(input: Any) -> Tuple[Optional[Any], Tensor]:
            return None, model.step(input)

        return step

    return runner


RUNNERS = [
    pytest.param(gpipe, id="gpipe"),
    pytest.param(pipeline("1f1b"), id="pipeline-1f1b"),
    pytest.param(pipeline("zero_bubble"), id="pipeline-zero_bubble"),
]


def padding_mask(batch: int, length: int) -> Tensor:
    lengths = torch.randint(1, length + 1, (batch,))
    return torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)


#: name -> (module builder, input builder for a batch size). Every model has the batch semantics that
#: micro-batches keep (no BatchNorm in training, no dropout).
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[int], Tuple[Tensor, ...]]]] = {
    "residual": (ResidualNet, lambda n: (torch.randn(n, 3, 8, 8),)),
    "unet": (UNet, lambda n: (torch.randn(n, 3, 8, 8),)),
    "encoder": (Encoder, lambda n: (torch.randint(0, 20, (n, 5)), padding_mask(n, 5))),
    "two-in-two-out": (TwoInTwoOut, lambda n: (torch.randn(n, 6), torch.randn(n, 6))),
}


def leaves(inputs: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)


def check_transparent(
    runner: Runner, module: nn.Module, inputs: Sequence[Tensor], balance: Optional[List[int]], chunks: int,
    checkpoint: str, seq: Optional[nn.Sequential] = None,
) -> None:
    """Trains one step of ``module`` plainly and of ``runner(as_sequential(module))``; compares everything."""
    reference = copy.deepcopy(module)
    if seq is None:
        seq = torchpipe.as_sequential(module, *inputs)
    if balance is None:
        balance = [len(seq)]

    plain_inputs, piped_inputs = leaves(inputs), leaves(inputs)
    expected = reference(*plain_inputs)
    expected_loss = loss_of(expected)
    expected_loss.backward()
    output, loss = runner(seq, balance, chunks, checkpoint)(
        piped_inputs[0] if len(piped_inputs) == 1 else piped_inputs
    )

    assert torch.allclose(loss, expected_loss, rtol=1e-5, atol=1e-5)
    if output is not None:
        assert type(output) is type(expected)
        for a, e in zip(flat(output), flat(expected)):
            assert a.shape == e.shape and torch.allclose(a, e, atol=1e-6)
        for a, e in zip(piped_inputs, plain_inputs):
            assert (a.grad is None) == (e.grad is None)
            if e.grad is not None:
                assert torch.allclose(a.grad, e.grad, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), module.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(q.grad, p.grad, atol=1e-5), name


@st.composite
def balances(draw: st.DrawFn, layers: int, most: int = 4) -> List[int]:
    partitions = draw(st.integers(1, min(most, layers)))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=partitions - 1, max_size=partitions - 1)))
    edges = [0, *cuts, layers]
    return [b - a for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=4)
@given(data=st.data(), batch=st.integers(1, 6), chunks=st.integers(1, 4))
def test_pipelined_module_equals_module(
    runner: Runner, checkpoint: str, name: str, data: st.DataObject, batch: int, chunks: int
) -> None:
    build, example = MODELS[name]
    torch.manual_seed(batch * 7 + chunks)
    module = build()
    inputs = example(batch)
    seq = torchpipe.as_sequential(module, *example(2))
    balance = data.draw(balances(len(seq)))
    check_transparent(runner, module, inputs, balance, chunks, checkpoint, seq)


def every_balance(layers: int, most: int) -> List[List[int]]:
    found = []
    for partitions in range(1, most + 1):
        for cuts in itertools.combinations(range(1, layers), partitions - 1):
            edges = [0, *cuts, layers]
            found.append([b - a for a, b in zip(edges, edges[1:])])
    return found


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_every_balance_of_a_two_input_two_output_module(runner: Runner, checkpoint: str) -> None:
    module = TwoInTwoOut()
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    seq = torchpipe.as_sequential(module, x, y)
    for balance in every_balance(len(seq), len(seq)):
        for p in module.parameters():
            p.grad = None
        check_transparent(runner, module, (x, y), balance, 3, checkpoint, seq)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_every_balance_of_a_transformer_encoder_with_a_mask(runner: Runner, checkpoint: str) -> None:
    module = Encoder(depth=3)
    inputs = (torch.randint(0, 20, (4, 5)), padding_mask(4, 5))
    seq = torchpipe.as_sequential(module, *inputs)
    for balance in every_balance(len(seq), 3):
        for p in module.parameters():
            p.grad = None
        check_transparent(runner, module, inputs, balance, 2, checkpoint, seq)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_batch_norm_resnet_in_one_micro_batch(runner: Runner, checkpoint: str) -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    x = torch.randn(4, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    check_transparent(runner, module, (x,), [5, 6, 5, 5], 1, checkpoint, seq)


@pytest.mark.parametrize("runner", RUNNERS)
def test_split_points_pipeline(runner: Runner) -> None:
    module = ResidualNet()
    x = torch.randn(6, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x, split_points=["layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"])
    check_transparent(runner, module, (x,), [2, 2, 2], 3, "always", seq)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@settings(max_examples=3)
@given(data=st.data(), chunks=st.integers(1, 4))
def test_torchvision_resnet18(runner: Runner, checkpoint: str, data: st.DataObject, chunks: int) -> None:
    try:
        import torchvision  # type: ignore[import-untyped]
    except Exception as error:  # noqa: BLE001 - a CUDA build beside a CPU torch fails with RuntimeError too
        pytest.skip(f"torchvision is not usable here ({type(error).__name__}: {error})")
    torch.manual_seed(chunks)
    # GroupNorm instead of BatchNorm, so that micro-batches keep the mini-batch's numbers.
    module = torchvision.models.resnet18(num_classes=5, norm_layer=lambda c: nn.GroupNorm(2, c))
    x = torch.randn(4, 3, 32, 32)
    seq = torchpipe.as_sequential(module, x[:2])
    check_transparent(runner, module, (x,), data.draw(balances(len(seq))), chunks, checkpoint, seq)


def test_deferred_batch_norm_updates_the_modules_running_statistics_once() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    reference = copy.deepcopy(module)
    x = torch.randn(8, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    piped = torchpipe.GPipe(seq, [10, 11], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    piped(x)
    reference(x)
    # The first BatchNorm sees the same numbers in both (later ones see activations normalised per micro-batch).
    assert torch.allclose(module.bn1.running_mean, reference.bn1.running_mean, atol=1e-6)
    assert torch.allclose(module.bn1.running_var, reference.bn1.running_var, atol=1e-6)
    counts = {name: int(b) for name, b in module.named_buffers() if name.endswith("num_batches_tracked")}
    assert len(counts) == 10 and set(counts.values()) == {1}


def test_a_long_skip_goes_straight_to_the_partition_that_uses_it() -> None:
    module = UNet(levels=2)
    x = torch.randn(4, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    names = [layer.name for layer in seq]
    assert names == ["down.0.0", "down.1.0", "bottom", "up.0", "merge.0", "up.1", "merge.1", "head"]
    piped = torchpipe.GPipe(seq, [1, 1, 1, 1, 1, 1, 2], devices=["cpu"] * 7, chunks=2)
    with record_transfers() as log:
        piped(x).sum().backward()
    skips = sorted({(r.source, r.target) for r in log if r.kind == "skip"})
    # The outer skip (the first level's output) goes from partition 0 to up.1 (5), whose layer
    # concatenates it, the inner one from 1 to up.0 (3); nothing else jumps.
    assert skips == [(0, 5), (1, 3)]
    assert all(abs(r.source - r.target) == 1 for r in log if r.kind == "activation")
