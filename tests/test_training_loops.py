"""Training loops as people write them, in one process: token-level losses of a padded language model,
gradient accumulation, auxiliary losses, and the errors a user meets on the way."""
import copy
import io
import math
from typing import Any, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchpipe
from tests.loops import (
    IGNORE,
    llama,
    mixtral,
    mixtral_outputs,
    padded_batch,
    plain_loss,
    token_loss,
    tokens,
    traced_llama,
    with_aux_loss,
)
from torchpipe import GPipe, Pipeline

CPU2 = ["cpu", "cpu"]


def _grads_equal(model: nn.Module, plain: nn.Module, atol: float = 1e-12, rtol: float = 1e-5) -> None:
    held = dict(model.named_parameters())
    for name, want in plain.named_parameters():
        got = held[name].grad
        assert got is not None and torch.allclose(got, want.grad, rtol=rtol, atol=atol), name


def _small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)).double()


def _classes(rows: int, ignored: List[int]) -> Any:
    torch.manual_seed(1)
    x = torch.randn(rows, 4, dtype=torch.float64)
    y = torch.randint(0, 5, (rows,))
    y[ignored] = IGNORE
    return x, y


def _ce(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(output, target, ignore_index=IGNORE)


# --- token-level losses -------------------------------------------------------------------------------


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 4), ("gpipe", 3), ("zero_bubble", 5), ("interleaved_1f1b", 4)])
def test_a_padded_language_models_token_loss_equals_the_plain_models(schedule: str, chunks: int) -> None:
    model = llama()
    plain = copy.deepcopy(model)
    seq = traced_llama(model)
    stages = 4 if schedule == "interleaved_1f1b" else 2
    balance = [len(seq) // stages] * (stages - 1) + [len(seq) - (len(seq) // stages) * (stages - 1)]
    pipe = Pipeline(seq, balance, chunks=chunks, schedule=schedule, loss_fn=token_loss, loss_weight=tokens,
                    devices=CPU2)
    batch, labels = padded_batch(7, seed=3)  # 7 rows in 3 to 5 micro-batches: uneven
    loss = pipe.step(batch, labels)
    expected = plain_loss(plain, batch, labels)
    expected.backward()
    assert torch.allclose(loss, expected.detach())
    _grads_equal(model, plain, atol=1e-10)


def test_without_loss_weight_the_micro_batches_count_by_their_samples_not_their_tokens() -> None:
    # What the issue measured: each micro-batch's token mean weighted by its rows is not the batch's token mean.
    model = llama()
    plain = copy.deepcopy(model)
    seq = traced_llama(model)
    pipe = Pipeline(seq, [len(seq) // 2, len(seq) - len(seq) // 2], chunks=4, loss_fn=token_loss, devices=CPU2)
    batch, labels = padded_batch(6, seed=3)
    loss = pipe.step(batch, labels)
    assert not torch.allclose(loss, plain_loss(plain, batch, labels).detach())


def test_a_micro_batch_whose_labels_are_all_ignored_adds_nothing_not_its_nan() -> None:
    model, plain = _small(), _small()
    x, y = _classes(8, ignored=[0, 1, 2, 3])  # the first of two micro-batches has no label
    pipe = Pipeline(model, [2, 1], chunks=2, loss_fn=_ce, loss_weight=tokens, devices=CPU2)
    loss = pipe.step(x, y)
    expected = _ce(plain(x), y)
    expected.backward()
    assert math.isfinite(loss.item()) and torch.allclose(loss, expected.detach())
    _grads_equal(model, plain)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), chunks=st.integers(1, 5), ignored=st.sets(st.integers(0, 8), max_size=8))
def test_token_weights_give_the_plain_mean_for_any_batch_chunks_and_padding(
    rows: int, chunks: int, ignored: Any
) -> None:
    ignored = sorted(i for i in ignored if i < rows)
    if len(ignored) == rows:
        ignored = ignored[1:]  # one label at least: a mean over nothing is an error (tested below)
    model, plain = _small(), _small()
    x, y = _classes(rows, ignored)
    pipe = Pipeline(model, [2, 1], chunks=chunks, loss_fn=_ce, loss_weight=tokens, devices=CPU2)
    loss = pipe.step(x, y)
    expected = _ce(plain(x), y)
    expected.backward()
    assert torch.allclose(loss, expected.detach())
    _grads_equal(model, plain)


@pytest.mark.parametrize("weight, message", [
    (lambda y: -1, "micro-batch 0 the weight -1.0: a weight must be finite and not negative"),
    (lambda y: float("nan"), "micro-batch 0 the weight nan"),
    (lambda y: torch.ones(2), "got a tensor of shape (2,) for micro-batch 0"),
    (lambda y: "3", "got '3' for micro-batch 0"),
    (lambda y: 0, "gave the whole mini-batch the weight 0.0"),
])
def test_bad_loss_weights_are_value_errors_naming_them(weight: Any, message: str) -> None:
    x, y = _classes(4, ignored=[])
    pipe = Pipeline(_small(), [2, 1], chunks=2, loss_fn=_ce, loss_weight=weight, devices=CPU2)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipe.step(x, y)
    pipe.loss_weight = tokens
    assert math.isfinite(pipe.step(x, y).item())  # the next step works


def test_loss_weight_needs_a_mean_and_a_function() -> None:
    with pytest.raises(ValueError, match="loss_reduction='sum' the micro-batches' losses are added"):
        Pipeline(_small(), [2, 1], loss_fn=_ce, loss_reduction="sum", loss_weight=tokens, devices=CPU2)
    with pytest.raises(TypeError, match="loss_weight must be a function"):
        Pipeline(_small(), [2, 1], loss_fn=_ce, loss_weight=3, devices=CPU2)  # type: ignore[arg-type]


# --- accumulation -------------------------------------------------------------------------------------


def test_steps_scaled_by_loss_scale_accumulate_as_the_plain_loop() -> None:
    # Dividing the returned loss does nothing to the gradients (it has no graph): the run ended 2.4e-2
    # off after 3 updates. loss_scale scales what the step adds to .grad.
    model, plain = _small(), _small()
    pipe = Pipeline(model, [2, 1], chunks=3, loss_fn=_ce, loss_weight=tokens, devices=CPU2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    for _ in range(3):
        for k in range(2):
            x, y = _classes(6, ignored=[k, 3])
            loss = pipe.step(x, y, loss_scale=1 / 2)
            expected = _ce(plain(x), y)
            (expected / 2).backward()
            assert torch.allclose(loss, expected.detach())  # the loss returned is not scaled
        _grads_equal(model, plain)
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    for got, want in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(got, want, atol=1e-12)


def test_the_returned_loss_says_to_use_step_when_backward_is_called() -> None:
    pipe = Pipeline(_small(), [2, 1], chunks=2, loss_fn=_ce, devices=CPU2)
    loss = pipe.step(*_classes(4, ignored=[]))
    assert not loss.requires_grad and loss.grad_fn is None and loss.dim() == 0
    for wrong in (loss, loss / 2):  # the (loss / 2).backward() said "element 0 ... does not require grad"
        with pytest.raises(RuntimeError, match=r"step\(\) ran the backward already.*loss_scale=1 / n"):
            wrong.backward()
    buffer = io.BytesIO()
    torch.save({"loss": loss}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)["loss"]
    assert type(saved) is Tensor and saved.item() == loss.item() and repr(loss) == repr(saved)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_loss_scale_that_is_not_finite_is_a_value_error(scale: float) -> None:
    pipe = Pipeline(_small(), [2, 1], loss_fn=_ce, devices=CPU2)
    with pytest.raises(ValueError, match="loss_scale must be a finite number"):
        pipe.step(*_classes(4, ignored=[]), loss_scale=scale)


# --- auxiliary losses ---------------------------------------------------------------------------------


def test_a_routers_auxiliary_loss_counts_per_micro_batch_as_gradient_accumulation_would() -> None:
    # The documented recipe: as_sequential(..., output=lambda o: (o.logits, o.aux_loss)) and a loss_fn that adds
    # the term. The load-balancing loss is not linear in the batch: the pipeline's is that of each micro-batch,
    # weighted as its token loss is, which is what plain gradient accumulation over the micro-batches computes.
    model = mixtral()
    plain = copy.deepcopy(model)
    (ids, mask), labels = padded_batch(6, seed=5)
    seq = torchpipe.as_sequential(model, input_ids=ids[:2], attention_mask=mask[:2], output=mixtral_outputs,
                                  use_cache=False)
    pipe = Pipeline(seq, [len(seq) // 2, len(seq) - len(seq) // 2], chunks=3, loss_fn=with_aux_loss,
                    loss_weight=tokens, devices=CPU2)
    loss = pipe.step((ids, mask), labels)
    total = tokens(labels)
    expected = torch.zeros(())
    for part in range(3):
        rows = slice(2 * part, 2 * part + 2)
        out = plain(input_ids=ids[rows], attention_mask=mask[rows], use_cache=False)
        micro = with_aux_loss((out.logits, out.aux_loss), labels[rows]) * tokens(labels[rows]) / total
        micro.backward()
        expected += micro.detach()
    assert out.aux_loss.item() > 0  # the term is there
    assert torch.allclose(loss, expected, rtol=1e-5)
    _grads_equal(model, plain, atol=1e-6, rtol=1e-4)  # float32


# --- small things a user hits ---------------------------------------------------------------------------


def test_pipelines_chunks_must_be_an_int_while_gpipe_keeps_torchgpipes_rule() -> None:
    with pytest.raises(TypeError, match="chunks must be an int"):
        Pipeline(_small(), [2, 1], chunks=2.0, devices=CPU2)  # type: ignore[arg-type]
    assert GPipe(_small(), [2, 1], chunks=2.0, devices=CPU2).chunks == 2  # type: ignore[arg-type]


@pytest.mark.parametrize("wrapper", [GPipe, Pipeline])
def test_a_module_that_is_not_a_sequential_is_a_type_error_naming_as_sequential(wrapper: Any) -> None:
    with pytest.raises(TypeError, match=r"torchpipe.as_sequential\(model, example_input\)"):
        wrapper(nn.Linear(2, 2), [1], devices=["cpu"])


def test_a_missing_target_says_to_pass_it() -> None:
    pipe = Pipeline(_small(), [2, 1], loss_fn=_ce, devices=CPU2)
    with pytest.raises(ValueError, match=r"the step must pass the target: loss_fn takes \(output, target\)"):
        pipe.step(torch.randn(4, 4, dtype=torch.float64))
    own = Pipeline(_small(), [2, 1], loss_fn=lambda output: output.square().mean(), devices=CPU2)
    assert own.step(torch.randn(4, 4, dtype=torch.float64)).item() > 0  # a loss of the output alone needs none
