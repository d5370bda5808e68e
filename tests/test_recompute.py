"""recompute='selective' and policies: a checkpointed micro-batch keeps what the policy names and recomputes the
rest, with the plain module's loss and gradients (see [Note: selective recomputation])."""
import copy
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tests.models import cpu_gpipe, grads_of, skippable_unet
from torchpipe import GPipe, Pipeline, is_recomputing
from torchpipe.recompute import kept

pytestmark = pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"),
    reason="selective recomputation needs torch.utils.checkpoint.create_selective_checkpoint_contexts",
)


def block(width: int = 8) -> nn.Sequential:
    """Linear, norm, activation, dropout: a kept output (the matmul) and recomputed ones around it."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.GELU(), nn.Dropout(0.25),
                         nn.Linear(2 * width, width))


def model(blocks: int = 4, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block(width) for _ in range(blocks)]).double()


def pipeline_grads(module: nn.Sequential, seed: int = 5, **kwargs: Any) -> Tuple[Tensor, List[Tensor]]:
    pipe = Pipeline(copy.deepcopy(module), [2, 2], chunks=4, loss_fn=F.mse_loss, devices=["cpu", "cpu"], **kwargs)
    torch.manual_seed(seed)
    x = torch.randn(16, 8, dtype=torch.float64)
    loss = pipe.step(x, torch.zeros(16, 8, dtype=torch.float64))
    return loss, grads_of(pipe)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_selective_pipeline_has_the_plain_gradients_with_dropout(schedule: str, checkpoint: str) -> None:
    # Dropout draws the same mask in the forward and the recomputation, selective or not: all three agree bit for
    # bit with the uncheckpointed pipeline of the same seed. Exact, since every pass runs the same kernels on the
    # same micro-batches (a kept output is the very tensor the forward made).
    module = model()
    never = pipeline_grads(module, schedule=schedule)
    full = pipeline_grads(module, schedule=schedule, checkpoint=checkpoint)
    selective = pipeline_grads(module, schedule=schedule, checkpoint=checkpoint, recompute="selective")
    for other in (full, selective):
        torch.testing.assert_close(other[0], never[0], rtol=0, atol=0)
        for a, b in zip(other[1], never[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_selective_gpipe_equals_the_plain_module() -> None:
    module = model().eval()  # no dropout: the plain module's gradients are the reference
    for m in module.modules():
        m.train(not isinstance(m, nn.Dropout))
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(module)
    plain(x).square().sum().backward()
    expected_input = x.grad
    x.grad = None
    g = cpu_gpipe(copy.deepcopy(module), [3, 1], chunks=3, checkpoint="always", recompute="selective")
    g(x).square().sum().backward()
    torch.testing.assert_close(x.grad, expected_input)
    for a, b in zip(grads_of(g), grads_of(plain)):
        torch.testing.assert_close(a, b)


class KeepsMatmul(nn.Module):
    """Records the storage its input (a Linear's output) has in each pass of a micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: List[Tuple[bool, int]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.storages.append((is_recomputing(), x.untyped_storage().data_ptr()))
        return F.gelu(x)


def test_selective_recomputation_takes_the_kept_matmul_output_back() -> None:
    torch.manual_seed(0)
    probe = KeepsMatmul()
    module = nn.Sequential(nn.Linear(4, 4), probe, nn.Linear(4, 2))
    g = cpu_gpipe(module, [2, 1], chunks=2, checkpoint="always", recompute="selective")
    g(torch.randn(4, 4)).sum().backward()
    first = [ptr for again, ptr in probe.storages if not again]
    recomputed = [ptr for again, ptr in probe.storages if again]
    # Each micro-batch's recomputation got the very tensor its forward made (the Linear did not run again).
    assert sorted(first) == sorted(recomputed) and len(first) == 2


def _counted_library() -> Tuple[Callable[[Tensor, Tensor], Tensor], List[bool]]:
    """A custom matmul operator that counts its runs (False: first forward, True: recomputation)."""
    runs: List[bool] = []

    @torch.library.custom_op("torchpipe_test::counted_mm", mutates_args=())
    def counted_mm(a: Tensor, b: Tensor) -> Tensor:
        runs.append(is_recomputing())
        return a @ b

    @counted_mm.register_fake
    def _(a: Tensor, b: Tensor) -> Tensor:
        return a.new_empty(a.shape[0], b.shape[1])

    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:
        a, b = ctx.saved_tensors
        return grad @ b.T, a.T @ grad

    def setup(ctx: Any, inputs: Tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    counted_mm.register_autograd(backward, setup_context=setup)
    return counted_mm, runs


COUNTED, RUNS = _counted_library() if hasattr(torch.library, "custom_op") else (None, [])


class CountedLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x: Tensor) -> Tensor:
        assert COUNTED is not None
        return torch.tanh(COUNTED(x, self.weight))


@pytest.mark.skipif(COUNTED is None, reason="needs torch.library.custom_op")
@pytest.mark.parametrize("recompute", ["full", "policy"])
def test_a_policy_keeps_what_it_names(recompute: str) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(CountedLinear(4), CountedLinear(4), nn.Linear(4, 1))
    plain = copy.deepcopy(module)
    policy = (lambda op: op.overloadpacket is torch.ops.torchpipe_test.counted_mm) if recompute == "policy" else "full"
    pipe = Pipeline(module, [2, 1], chunks=2, loss_fn=lambda out: out.sum(), loss_reduction="sum",
                    checkpoint="always", recompute=policy, devices=["cpu", "cpu"])
    x = torch.randn(4, 4)
    RUNS.clear()
    loss = pipe.step(x)
    # Two layers, two micro-batches: four first runs; 'full' runs them all again, the policy none.
    assert RUNS.count(False) == 4
    assert RUNS.count(True) == (4 if recompute == "full" else 0)
    expected = plain(x).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b)


def test_the_default_policy_keeps_matmuls_attention_and_collectives_only() -> None:
    aten = torch.ops.aten
    assert kept(aten.mm.default) and kept(aten.addmm.default) and kept(aten.bmm.default)
    assert kept(aten.convolution.default)
    assert kept(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not kept(aten.gelu.default) and not kept(aten.native_layer_norm.default) and not kept(aten.add.Tensor)


def test_selective_with_skips_and_deferred_batch_norm() -> None:
    # Batch norm normalises each micro-batch by its own statistics, so the reference is the pipeline that
    # checkpoints nothing; deferred, the running statistics are the plain module's.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), *skippable_unet(depth=2, width=4)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    plain = copy.deepcopy(module)
    plain(x)
    pipes = []
    for checkpoint, recompute in (("never", "full"), ("always", "selective")):
        pipe = Pipeline(copy.deepcopy(module), [3, 4], chunks=4, loss_fn=lambda out: out.sum(),
                        loss_reduction="sum", checkpoint=checkpoint, recompute=recompute, deferred_batch_norm=True,
                        devices=["cpu", "cpu"])
        pipe.step(x)
        pipes.append(pipe)
    never, selective = pipes
    for a, b in zip(grads_of(selective), grads_of(never)):  # exact: the same kernels on the same micro-batches
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for key in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(selective.state_dict()[key], plain.state_dict()[key])


@settings(max_examples=12, deadline=None)
@given(chunks=st.integers(1, 4), balance=st.sampled_from([[1, 3], [2, 2], [3, 1]]), seed=st.integers(0, 50))
def test_selective_equals_full_for_any_cut(chunks: int, balance: List[int], seed: int) -> None:
    module = model(blocks=4)
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    losses, grads = [], []
    for recompute in ("full", "selective"):
        pipe = Pipeline(copy.deepcopy(module), balance, chunks=chunks, loss_fn=lambda out: out.square().mean(),
                        checkpoint="except_last", recompute=recompute, devices=["cpu", "cpu"])
        torch.manual_seed(seed)
        losses.append(pipe.step(x))
        grads.append(grads_of(pipe))
    # Exact: the same cut and micro-batches; selective takes back outputs its forward computed as full recomputes them.
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_in_place_change_of_a_kept_output_is_a_clear_error() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    pipe = Pipeline(module, [2, 1], chunks=2, loss_fn=lambda out: out.sum(), checkpoint="always",
                    recompute="selective", devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match=r"changed in place an output that selective recomputation keeps.*"
                                           r"recompute='full'"):
        pipe.step(torch.randn(4, 4))


def test_recompute_needs_checkpointed_micro_batches() -> None:
    with pytest.raises(ValueError, match="checkpoint= picks the micro-batches to recompute"):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], recompute="selective", devices=["cpu"])
    with pytest.raises(ValueError, match="checkpoint= picks the micro-batches to recompute"):
        GPipe(nn.Sequential(nn.Linear(2, 2)), [1], checkpoint="never", recompute=kept, devices=["cpu"])
    with pytest.raises(ValueError, match="recompute must be 'full', 'selective' or a function"):
        GPipe(nn.Sequential(nn.Linear(2, 2)), [1], recompute="some", devices=["cpu"])
    with pytest.raises(TypeError, match="recompute must be 'full', 'selective' or a function"):
        GPipe(nn.Sequential(nn.Linear(2, 2)), [1], recompute=3, devices=["cpu"])  # type: ignore[arg-type]
    # 'full' with checkpoint='never' is the default of a Pipeline: nothing is recomputed, nothing to refuse.
    Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], recompute="full", devices=["cpu"])


def test_selective_with_compiled_layers() -> None:
    module = model(blocks=2).eval()
    x = torch.randn(8, 8, dtype=torch.float64)
    plain = copy.deepcopy(module)
    plain(x).square().mean().backward()
    pipe = Pipeline(copy.deepcopy(module), [1, 1], chunks=2, loss_fn=lambda out: out.square().mean(),
                    checkpoint="always", recompute="selective", devices=["cpu", "cpu"],
                    compile={"backend": "aot_eager"})
    pipe.train()
    for m in pipe.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    pipe.step(x)
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b)


class GradModeDependent(nn.Module):
    """Runs other operators with grad enabled than without, as DTensor's operators do (a view, then a matmul)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            x = x.view(x.shape)
        return torch.tanh(self.linear(x))


def test_the_first_forward_runs_the_operators_of_its_recomputation() -> None:
    # Found with DTensor stages: a first forward without grad ran other operators than its recomputation with
    # grad, which then found no kept output for an operator of its own ("aten.view.default ... not found in
    # storage"). Both passes run with grad; the first keeps no graph.
    torch.manual_seed(0)
    module = nn.Sequential(*[GradModeDependent(6) for _ in range(4)]).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    plain = copy.deepcopy(module)
    plain(x).sum().backward()
    pipe = Pipeline(copy.deepcopy(module), [2, 2], chunks=2, loss_fn=lambda out: out.sum(), loss_reduction="sum",
                    checkpoint="always", recompute="selective", devices=["cpu", "cpu"])
    pipe.step(x)
    for a, b in zip(grads_of(pipe), grads_of(plain)):
        torch.testing.assert_close(a, b)
