"""Transparency: a GPipe gives the plain module's outputs, input grads and parameter grads."""
import copy
from typing import List, Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import torchpipe
from tests.models import DEVICES, build

# What may follow a layer that returns a tensor / a (tensor, tensor) pair / a (tensor, index) pair.
AFTER_TENSOR = ["linear", "relu", "tanh", "norm", "fork", "index"]
AFTER_PAIR = ["both", "join"]
AFTER_INDEXED = ["use_index"]


@st.composite
def models(draw: st.DrawFn) -> Tuple[List[str], bool]:
    """Layer kinds of a random Sequential; and whether its input is a (tensor, tensor) pair."""
    tuple_input = draw(st.booleans())
    state = "pair" if tuple_input else "tensor"
    kinds: List[str] = []
    for _ in range(draw(st.integers(1, 7))):
        menu = {"tensor": AFTER_TENSOR, "pair": AFTER_PAIR, "indexed": AFTER_INDEXED}[state]
        if state == "tensor" and kinds and kinds[-1] in ("linear", "norm"):
            menu = menu + ["relu_"]  # in place, on a non-leaf (also the first layer of a partition)
        kind = draw(st.sampled_from(menu))
        kinds.append(kind)
        state = {"fork": "pair", "both": "pair", "index": "indexed"}.get(kind, "tensor")
    return kinds, tuple_input


@st.composite
def balances(draw: st.DrawFn, layers: int) -> List[int]:
    partitions = draw(st.integers(1, min(4, layers)))
    if partitions == 1:
        return [layers]
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=partitions - 1, max_size=partitions - 1)))
    edges = [0, *cuts, layers]
    return [b - a for a, b in zip(edges, edges[1:])]


def flatten(output: object) -> List[Tensor]:
    return [output] if isinstance(output, Tensor) else list(output)  # type: ignore[arg-type]


def loss_of(output: object) -> Tensor:
    tensors = flatten(output)
    zero = torch.zeros((), device=tensors[0].device)
    return sum((t.float().pow(2).sum() for t in tensors if t.is_floating_point()), zero)


def check_transparent(
    model: nn.Sequential, balance: List[int], chunks: int, checkpoint: str, input: Tuple[Tensor, ...],
    device: str = "cpu",
) -> None:
    plain = copy.deepcopy(model).to(device)
    piped = torchpipe.GPipe(model, balance, devices=[device] * len(balance), chunks=chunks, checkpoint=checkpoint)

    x_plain = tuple(t.detach().to(device, copy=True).requires_grad_(t.is_floating_point()) for t in input)
    x_piped = tuple(t.detach().to(device, copy=True).requires_grad_(t.is_floating_point()) for t in input)
    arg_plain = x_plain[0] if len(x_plain) == 1 else x_plain
    arg_piped = x_piped[0] if len(x_piped) == 1 else x_piped

    expected = plain(arg_plain)
    actual = piped(arg_piped)
    assert type(actual) is type(expected)
    for a, e in zip(flatten(actual), flatten(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert torch.allclose(a, e, atol=1e-6)

    loss_of(expected).backward()
    loss_of(actual).backward()
    for a, e in zip(x_piped, x_plain):
        if e.grad is None:
            assert a.grad is None or torch.count_nonzero(a.grad) == 0
        else:
            assert a.grad is not None
            assert torch.allclose(a.grad, e.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:
            assert q.grad is not None, name
            assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-5), name


@given(
    spec=models(),
    data=st.data(),
    batch=st.integers(1, 9),
    chunks=st.integers(1, 10),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
)
@pytest.mark.parametrize("device", DEVICES)
def test_random_models_are_transparent(
    spec: Tuple[List[str], bool], data: st.DataObject, batch: int, chunks: int, checkpoint: str, device: str
) -> None:
    kinds, tuple_input = spec
    width = 4
    torch.manual_seed(len(kinds) * 31 + batch)
    # In float64: a LayerNorm over 4 features can amplify gradients a hundredfold, and float32 sums taken in
    # another order (per micro-batch) then differ by more than any fixed tolerance; float64 leaves only the
    # pipeline's own mistakes.
    model = build(kinds, width).double()
    balance = data.draw(balances(len(kinds)))
    x = torch.randn(batch, width, dtype=torch.float64)
    input = (x, torch.randn(batch, width, dtype=torch.float64)) if tuple_input else (x,)
    check_transparent(model, balance, chunks, checkpoint, input, device)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 16])
@pytest.mark.parametrize("device", DEVICES)
def test_mlp_over_three_partitions(checkpoint: str, chunks: int, device: str) -> None:
    model = build(["linear", "relu", "linear", "relu_", "linear", "tanh", "linear"], 6)
    check_transparent(model, [2, 3, 2], chunks, checkpoint, (torch.randn(10, 6),), device)


@pytest.mark.parametrize("device", DEVICES)
def test_input_without_grad_gets_no_grad_but_parameters_do(device: str) -> None:
    model = build(["linear", "relu", "linear"], 4)
    piped = torchpipe.GPipe(model, [1, 2], devices=[device, device], chunks=2)
    x = torch.randn(6, 4)
    out = piped(x)
    assert out.requires_grad
    out.sum().backward()
    assert x.grad is None
    assert all(p.grad is not None for p in piped.parameters())


def test_frozen_model_and_plain_input_give_output_without_grad() -> None:
    model = build(["linear", "relu", "linear"], 4).requires_grad_(False)
    piped = torchpipe.GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2)
    out = piped(torch.randn(6, 4))
    assert not out.requires_grad
    assert torch.allclose(out, model(torch.randn(6, 4)) * 0 + out)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_draws_the_same_numbers_in_recomputation(checkpoint: str, device: str) -> None:
    # Gradients through dropout are right only if the recomputation's mask is the first forward's. Without
    # checkpointing there is no recomputation, and every micro-batch draws from its own stream, whatever
    # the checkpoint mode: so every mode gives the outputs and gradients of checkpoint='never'.
    def run(mode: str, seed: int = 7) -> Tuple[Tensor, List[Tensor]]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        piped = torchpipe.GPipe(model, [2, 3], devices=[device, device], chunks=4, checkpoint=mode)
        x = torch.randn(16, 8)
        torch.manual_seed(seed)
        out = piped(x)
        out.sum().backward()
        return out, [p.grad for p in piped.parameters()]

    out, grads = run(checkpoint)
    expected_out, expected_grads = run("never")
    assert torch.equal(out, expected_out)
    for got, expected in zip(grads, expected_grads):
        assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.equal(run(checkpoint, seed=8)[0], out), "dropout drew nothing: the test shows nothing"


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_masks_match_between_forward_and_recomputation_with_many_microbatches(
    checkpoint: str, device: str
) -> None:
    # A layer records the dropout mask it saw in the first forward and in the recomputation.
    seen: dict = {}

    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            key = (id(self), torchpipe.current_microbatch(), torchpipe.is_recomputing())
            seen[key] = (x == 0).clone()
            return x

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), Spy(), nn.Linear(8, 8), nn.Dropout(0.5), Spy())
    piped = torchpipe.GPipe(model, [3, 3], devices=[device, device], chunks=4, checkpoint=checkpoint)
    piped(torch.randn(16, 8) + 3).sum().backward()
    recomputed = [k for k in seen if k[2]]
    assert len(recomputed) == 2 * (4 if checkpoint == "always" else 3)
    for spy, microbatch, _ in recomputed:
        assert torch.equal(seen[(spy, microbatch, True)], seen[(spy, microbatch, False)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_to_dtype(dtype: torch.dtype) -> None:
    model = build(["linear", "relu", "linear"], 4)
    piped = torchpipe.GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2).to(dtype)
    assert all(p.dtype == dtype for p in piped.parameters())
    if dtype == torch.float64:
        out = piped(torch.randn(4, 4, dtype=dtype))
        assert out.dtype == dtype
