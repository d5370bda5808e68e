"""Tied parameters (issue 17): layers of different stages sharing one Parameter, in GPipe and Pipeline."""
import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from torchpipe import GPipe, Pipeline
from torchpipe.runtime.ties import TiedCopies

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
VOCAB, WIDTH = 11, 6


def tied_lm(layers: int = 4, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """An embedding, ``layers`` blocks, and a head whose weight is the embedding's (``head.weight is emb.weight``)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embedding.weight
    blocks: List[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(embedding, *blocks, head).to(dtype)


def tokens(batch: int = 6, length: int = 5, seed: int = 1) -> Tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, length), generator=generator),
            torch.randint(0, VOCAB, (batch, length), generator=generator))


def train_beside_plain(
    pipe: Pipeline, plain: nn.Module, optimizer: Any, *, steps: int, batch: int = 6
) -> None:
    """Trains ``pipe`` and ``plain`` on the same tokens, each with ``optimizer(parameters)``: every step's loss and
    gradients equal, and the tied weight's value after the steps."""
    ours, reference = optimizer(pipe.parameters()), optimizer(plain.parameters())
    for step in range(steps):
        x, y = tokens(batch=batch, seed=step)
        loss = pipe.step(x, y)
        expected = lm_loss(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads(pipe, plain)
        ours.step()
        reference.step()
        ours.zero_grad()
        reference.zero_grad()
    torch.testing.assert_close(pipe.state_dict()["0.weight"], plain.state_dict()["0.weight"])


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def grads(module: nn.Module) -> Dict[str, Tensor]:
    return {name: p.grad for name, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}


def assert_same_grads(got: nn.Module, want: nn.Module) -> None:
    expected = grads(want)
    found = grads(got)
    assert set(expected) <= set(found) | {k for k in expected if k not in dict(got.named_parameters())}
    for name, grad in found.items():
        plain = name.split(".", 2)[-1] if name.startswith("partitions.") else name
        torch.testing.assert_close(grad, expected[plain], msg=f"gradient of {name}")


# --- GPipe --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 9], [4, 6], [3, 3, 4], [9, 1]])
def test_gpipe_with_a_tied_embedding_and_head_is_transparent(balance: List[int], checkpoint: str) -> None:
    model = tied_lm()
    plain = copy.deepcopy(model)
    assert plain[-1].weight is plain[0].weight
    piped = GPipe(model, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint)
    assert piped[-1].weight is piped[0].weight, "holders on one device share the one tensor"
    assert len(list(piped.parameters())) == len(list(plain.parameters()))
    x, y = tokens()
    for _ in range(3):
        loss = lm_loss(piped(x), y)
        expected = lm_loss(plain(x), y)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        assert_same_grads(piped, plain)
        for m in (piped, plain):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None


def test_torch_autograd_grad_of_a_tied_parameter_through_gpipe() -> None:
    model = tied_lm()
    plain = copy.deepcopy(model)
    piped = GPipe(model, [2, 8], devices=["cpu", "cpu"], chunks=2)
    x, y = tokens()
    (got,) = torch.autograd.grad(lm_loss(piped(x), y), [piped[0].weight])
    (want,) = torch.autograd.grad(lm_loss(plain(x), y), [plain[0].weight])
    torch.testing.assert_close(got, want)
    assert piped[0].weight.grad is None


def test_gpipe_sums_the_gradients_of_copies_on_other_devices() -> None:
    # Holders on two devices get a copy each (there is no second device here: the copy is made by hand, as
    # untie_devices does); the gradient returned for each copy is the sum of both, so each .grad is the
    # plain module's.
    model = tied_lm()
    plain = copy.deepcopy(model)
    piped = GPipe(model, [4, 6], devices=["cpu", "cpu"], chunks=3)
    head = piped[-1]
    head.weight = nn.Parameter(head.weight.detach().clone())
    piped._runner.stages.tied_copies = [[piped[0].weight, head.weight]]
    piped._runner.stages.share([])
    x, y = tokens()
    lm_loss(piped(x), y).backward()
    lm_loss(plain(x), y).backward()
    torch.testing.assert_close(piped[0].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(head.weight.grad, plain[0].weight.grad)


# --- Pipeline in one process ------------------------------------------------------------------------------


def pipeline(model: nn.Sequential, schedule: str, stages: int, **kwargs: Any) -> Pipeline:
    layers = len(model)
    balance = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    devices = ["cpu"] * (stages // 2 if schedule == "interleaved_1f1b" else stages)
    return Pipeline(model, balance, chunks=3, schedule=schedule, loss_fn=lm_loss, devices=devices, **kwargs)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_with_tied_weights_is_transparent_over_steps(schedule: str, stages: int) -> None:
    model = tied_lm()
    plain = copy.deepcopy(model)
    pipe = pipeline(model, schedule, stages)
    train_beside_plain(pipe, plain, lambda params: torch.optim.Adam(params, lr=0.05), steps=3)
    keys = [k for k in pipe.state_dict() if k.endswith("weight")]
    assert keys[0] == "0.weight" and keys[-1] == f"{len(model) - 1}.weight", "every plain key of the tie"


def test_pipeline_sums_tied_copies_and_keeps_accumulated_gradients() -> None:
    # The one-process copy path (holders on two devices), the copy made by hand as untie_devices would: each
    # copy's .grad is the plain module's after every step, gradient accumulation over steps included.
    model = tied_lm()
    plain = copy.deepcopy(model)
    pipe = pipeline(model, "1f1b", 2)
    head = pipe.stages[1][-1]  # type: ignore[index]
    head.weight = nn.Parameter(head.weight.detach().clone())
    pipe._runner.hooks.append(TiedCopies([[pipe.stages[0][0].weight, head.weight]]))  # type: ignore[index]
    for step in range(2):  # no zero_grad in between: gradients accumulate, as with the plain module
        x, y = tokens(seed=step)
        pipe.step(x, y)
        lm_loss(plain(x), y).backward()
        torch.testing.assert_close(head.weight.grad, plain[0].weight.grad)
        torch.testing.assert_close(pipe.stages[0][0].weight.grad, plain[0].weight.grad)  # type: ignore[index]


def test_a_state_dict_loads_into_every_holder() -> None:
    model = tied_lm()
    pipe = pipeline(model, "1f1b", 2)
    other = tied_lm()
    with torch.no_grad():
        other[0].weight.mul_(3)
    pipe.load_state_dict(other.state_dict())
    torch.testing.assert_close(pipe.stages[1][-1].weight, other[0].weight)  # type: ignore[index]
    fresh = tied_lm()
    fresh.load_state_dict(pipe.full_state_dict())
    torch.testing.assert_close(fresh[-1].weight, other[0].weight)


def test_a_meta_model_keeps_its_tie_when_materialised() -> None:
    with torch.device("meta"):
        model = tied_lm()
    pipe = pipeline(model, "1f1b", 2)
    first, last = pipe.stages[0][0].weight, pipe.stages[1][-1].weight  # type: ignore[index]
    assert not first.is_meta and first is last


def test_shared_buffers_are_refused() -> None:
    a, b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    b.running_var = a.running_var
    with pytest.raises(ValueError, match="buffer shared"):
        Pipeline(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])


# --- clipping ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.5])
@pytest.mark.parametrize("copied", [False, True])
def test_clip_grad_norm_counts_a_tied_parameter_once(norm_type: float, copied: bool) -> None:
    # The plain module's clip_grad_norm_ sees the tied weight once; so must the pipeline's, also when the
    # holders keep copies (on other devices: made by hand here, as untie_devices does).
    model = tied_lm()
    plain = copy.deepcopy(model)
    pipe = pipeline(model, "1f1b", 2)
    head = pipe.stages[1][-1]  # type: ignore[index]
    if copied:
        head.weight = nn.Parameter(head.weight.detach().clone())
        pipe._runner.hooks.append(TiedCopies([[pipe.stages[0][0].weight, head.weight]]))  # type: ignore[index]
    x, y = tokens()
    pipe.step(x, y)
    lm_loss(plain(x), y).backward()
    got = pipe.clip_grad_norm_(0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type)
    torch.testing.assert_close(got, want)
    assert got > 0.1, "the test clips nothing"
    assert_same_grads(pipe, plain)
    torch.testing.assert_close(head.weight.grad, plain[0].weight.grad)


def test_gpipe_clip_grad_norm_counts_copies_once() -> None:
    model = tied_lm()
    plain = copy.deepcopy(model)
    piped = GPipe(model, [4, 6], devices=["cpu", "cpu"], chunks=3)
    head = piped[-1]
    head.weight = nn.Parameter(head.weight.detach().clone())
    piped._runner.stages.tied_copies = [[piped[0].weight, head.weight]]
    piped._runner.stages.share([])
    x, y = tokens()
    lm_loss(piped(x), y).backward()
    lm_loss(plain(x), y).backward()
    torch.testing.assert_close(piped.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
    torch.testing.assert_close(head.weight.grad, plain[0].weight.grad)


def test_clip_grad_norm_errors_like_pytorch() -> None:
    pipe = pipeline(tied_lm(), "1f1b", 2)
    x, y = tokens()
    pipe.step(x, y)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        pipe.clip_grad_norm_(1.0, norm_type=0)
    with torch.no_grad():
        next(pipe.parameters()).grad.fill_(float("nan"))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
