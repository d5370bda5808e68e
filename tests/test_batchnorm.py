"""Deferred batch norm: running statistics equal whole-batch BatchNorm's, updated once per mini-batch."""
import copy

import pytest
import torch
from torch import nn

from torchpipe import GPipe
from torchpipe.batchnorm import DeferredBatchNorm


def bn_model(momentum: object = 0.1) -> nn.Sequential:
    # One BatchNorm, in the second partition ([2, 3]): its input is the same as in the plain module.
    # (A BatchNorm after another one sees micro-batch-normalised inputs, which differ by design.)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(4, momentum=momentum), nn.Conv2d(4, 4, 1), nn.Tanh()
    )


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_equal_whole_batch_batchnorm(chunks: int, checkpoint: str, momentum: object) -> None:
    model = bn_model(momentum=momentum)
    plain = copy.deepcopy(model)
    piped = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
    for _ in range(3):
        x = torch.randn(10, 3, 5, 5)
        plain(x).sum().backward()
        piped(x).sum().backward()
    for name in ("2",):
        a, b = getattr(plain, name), piped[int(name)]
        assert isinstance(b, DeferredBatchNorm)
        assert torch.allclose(a.running_mean, b.running_mean, atol=1e-6)
        assert torch.allclose(a.running_var, b.running_var, atol=1e-5)
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 3


def test_batchnorm1d_and_no_grad_forward_also_commit() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    plain = copy.deepcopy(model)
    piped = GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(12, 4)
    with torch.no_grad():
        plain(x)
        piped(x)
    assert torch.allclose(plain[1].running_mean, piped[1].running_mean, atol=1e-6)
    assert torch.allclose(plain[1].running_var, piped[1].running_var, atol=1e-5)


def test_without_deferral_statistics_update_per_microbatch() -> None:
    piped = GPipe(bn_model(), [2, 3], devices=["cpu", "cpu"], chunks=4)
    piped(torch.randn(8, 3, 5, 5))
    assert int(piped[2].num_batches_tracked) == 4
    assert not isinstance(piped[2], DeferredBatchNorm)


def test_eval_mode_uses_running_statistics() -> None:
    model = bn_model()
    plain = copy.deepcopy(model).eval()
    piped = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=3, deferred_batch_norm=True).eval()
    x = torch.randn(6, 3, 5, 5)
    assert torch.allclose(piped(x), plain(x), atol=1e-6)
    assert int(piped[2].num_batches_tracked) == 0


def test_failed_step_leaves_statistics_untouched() -> None:
    class Fail(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no")

    model = nn.Sequential(nn.BatchNorm1d(2), Fail())
    piped = GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    with pytest.raises(RuntimeError, match="no"):
        piped(torch.randn(4, 2))
    assert int(piped[0].num_batches_tracked) == 0
    assert torch.equal(piped[0].running_mean, torch.zeros(2))
    assert piped[0].count is None
