"""CUDA: streams, copies between devices, output device, and the backward-thread deadlock trap.

Every test here is marked ``cuda`` and skipped without a GPU (see conftest.py). The
deadlock tests carry a timeout so that a deadlock fails instead of hanging.
"""
import copy
import os
from typing import List

import pytest
import torch
from torch import Tensor, nn

from torchpipe import GPipe
from torchpipe.runtime.lease import process_lease
from torchpipe.skip import pop, skippable, stash

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]

#: The device of the second partition in the tests of two GPUs: ``cuda:1``, or the first GPU again where
#: ``TORCHPIPE_SECOND_GPU=cuda:0`` (benchmarks/gpu_check.py sets it on a machine with one GPU), so that those tests
#: run there too: their copies go between two streams of one device instead of between two devices.
SECOND_GPU = torch.device(os.environ.get("TORCHPIPE_SECOND_GPU", "cuda:1"))
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() <= (SECOND_GPU.index or 0),
                              reason=f"needs {SECOND_GPU} (TORCHPIPE_SECOND_GPU=cuda:0 puts it on the first GPU)")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def check(devices: List[str], checkpoint: str, chunks: int = 4) -> GPipe:
    plain = model()
    piped = GPipe(copy.deepcopy(plain), [2, 3], devices=devices, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(16, 8)
    plain.to(devices[0])
    x_plain = x.to(devices[0]).requires_grad_()
    x_piped = x.clone().requires_grad_()
    expected = plain(x_plain)
    actual = piped(x_piped)
    assert actual.device == torch.device(devices[-1]) if devices[-1] != "cuda" else actual.is_cuda
    assert torch.allclose(actual.to(expected.device), expected, atol=1e-5)
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    assert torch.allclose(x_piped.grad.to(x_plain.device), x_plain.grad, atol=1e-5)
    for p, q in zip(plain.parameters(), piped.parameters()):
        assert torch.allclose(q.grad.to(p.device), p.grad, atol=1e-5)
    return piped


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_two_partitions_on_one_gpu(checkpoint: str) -> None:
    check(["cuda:0", "cuda:0"], checkpoint)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpu_partition_then_cpu_partition(checkpoint: str) -> None:
    check(["cuda:0", "cpu"], checkpoint)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_cpu_partition_then_gpu_partition(checkpoint: str) -> None:
    check(["cpu", "cuda:0"], checkpoint)


@TWO_GPUS
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_two_gpus(checkpoint: str) -> None:
    piped = check(["cuda:0", str(SECOND_GPU)], checkpoint)
    assert next(piped.partitions[1].parameters()).device == SECOND_GPU


def test_default_devices_are_gpus() -> None:
    if torch.cuda.device_count() >= 2:
        piped = GPipe(model(), [2, 3])
        assert piped.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    else:
        with pytest.raises(IndexError, match="devices"):
            GPipe(model(), [2, 3])


def test_input_on_cpu_is_moved_and_output_lives_on_the_last_device() -> None:
    piped = GPipe(model(), [2, 3], devices=["cuda:0", "cuda:0"], chunks=2)
    out = piped(torch.randn(4, 8))
    assert out.device == torch.device("cuda:0")


class SlowWrite(nn.Module):
    """Writes its output only after a long GPU sleep: a copy that does not wait reads garbage."""

    def forward(self, x: Tensor) -> Tensor:
        out = torch.empty_like(x)
        torch.cuda._sleep(50_000_000)
        out.copy_(x * 3)
        return out


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0", "cpu"]])
def test_copies_wait_for_the_producer(devices: List[str]) -> None:
    piped = GPipe(nn.Sequential(SlowWrite(), nn.Identity()), [1, 1], devices=devices, chunks=4)
    x = torch.randn(8, 4, device="cuda:0")
    assert torch.equal(piped(x).to("cuda:0"), x * 3)


@TWO_GPUS
def test_copies_between_gpus_wait_for_the_producer() -> None:
    piped = GPipe(nn.Sequential(SlowWrite(), nn.Identity()), [1, 1], devices=["cuda:0", str(SECOND_GPU)], chunks=4)
    x = torch.randn(8, 4, device="cuda:0")
    assert torch.equal(piped(x).to("cuda:0"), x * 3)


def test_dropout_recomputation_on_gpu() -> None:
    layers = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    plain = copy.deepcopy(layers).cuda()
    piped = GPipe(layers, [2, 3], devices=["cuda:0", "cuda:0"], chunks=1, checkpoint="always")
    x = torch.randn(16, 8, device="cuda:0")
    torch.manual_seed(3)
    piped(x).sum().backward()
    torch.manual_seed(3)
    plain(x).sum().backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


@pytest.mark.parametrize("devices", [["cuda:0", "cpu", "cuda:0"], ["cpu", "cuda:0", "cuda:0"]])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_skip_between_devices(devices: List[str], checkpoint: str) -> None:
    module = nn.Sequential(Stash(), nn.Linear(4, 4), Pop())
    plain = copy.deepcopy(module)
    piped = GPipe(module, [1, 1, 1], devices=devices, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    x_plain, x_piped = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = plain(x_plain), piped(x_piped)
    assert torch.allclose(actual.cpu(), expected, atol=1e-5)
    expected.sum().backward()
    actual.sum().backward()
    assert torch.allclose(x_piped.grad.cpu(), x_plain.grad, atol=1e-5)


def test_copies_between_devices_are_on_the_timeline() -> None:
    import torchpipe

    piped = GPipe(model(), [2, 3], devices=["cuda:0", "cpu"], chunks=2)
    with torchpipe.trace.record_timeline() as timeline:
        piped(torch.randn(4, 8, device="cuda:0")).sum().backward()
    copies = sorted((s.partition, s.microbatch) for s in timeline if s.kind == "copy")
    # Activations 0 -> 1 and gradients 1 -> 0, for both micro-batches.
    assert copies == [(0, 0), (0, 1), (1, 0), (1, 1)]


# --- Pipeline on CUDA devices ------------------------------------------------------------------------------


def check_pipeline(devices: List[str], schedule: str, checkpoint: str) -> None:
    import torchpipe

    plain = model()
    stages = len(devices) if schedule != "interleaved_1f1b" else 2 * len(devices)
    layers = list(copy.deepcopy(plain).children())
    balance = [1] * (stages - 1) + [len(layers) - stages + 1]
    pipe = torchpipe.Pipeline(nn.Sequential(*layers), balance, chunks=4, schedule=schedule, checkpoint=checkpoint,
                              loss_fn=nn.functional.mse_loss, devices=devices)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    plain.to(devices[0])
    expected = nn.functional.mse_loss(plain(x.to(devices[0])), y.to(devices[0]))
    expected.backward()
    loss = pipe.step(x, y)
    assert torch.allclose(loss.to(expected.device), expected, atol=1e-5)
    for p, q in zip(plain.parameters(), pipe.parameters()):
        assert torch.allclose(q.grad.to(p.device), p.grad, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_pipeline_on_one_gpu_and_on_a_gpu_then_the_cpu(schedule: str, checkpoint: str) -> None:
    check_pipeline(["cuda:0", "cuda:0"], schedule, checkpoint)
    check_pipeline(["cuda:0", "cpu"], schedule, checkpoint)


@TWO_GPUS
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_on_two_gpus(schedule: str) -> None:
    check_pipeline(["cuda:0", str(SECOND_GPU)], schedule, "except_last")


def test_one_gpipe_on_a_gpu_trained_from_several_threads_gets_every_gradient() -> None:
    # [Note: gradient lease]: the engine runs the GPipe's backward on the GPU's own thread, which must not wait
    # for another thread's pass: a pass that meets one accumulates into .grad directly. Every thread's gradient
    # must still be in .grad once, and nothing may hang. (A CPU partition first: its parameters' accumulators
    # run on the callers' threads; with every partition on one GPU the engine's thread for it runs them all.)
    devices = ["cpu", "cuda:0"]
    import concurrent.futures

    plain = model()
    piped = GPipe(copy.deepcopy(plain), [2, 3], devices=devices, chunks=4)
    inputs = [torch.randn(16, 8) for _ in range(8)]
    for x in inputs:
        plain(x).sum().backward()

    def train(x: Tensor) -> None:
        piped(x).sum().backward()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(train, x) for x in inputs]:
            done.result(timeout=60)
    for p, q in zip(plain.parameters(), piped.parameters()):
        assert torch.allclose(q.grad.cpu(), p.grad, atol=1e-4)
    assert not process_lease().held


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_an_output_copied_off_its_gpu_is_released_and_the_gradients_stay(schedule: str) -> None:
    # The first stage ends in a Linear, whose output nothing saves: once copied to the CPU, its GPU memory goes
    # (the copy stream was recorded on it), and the stage keeps only its graph for the backward.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 256), nn.Linear(256, 4))
    from torchpipe import Pipeline
    from torchpipe.runtime import release as released

    pipe = Pipeline(copy.deepcopy(plain), [1, 1], chunks=4, schedule=schedule, loss_fn=nn.functional.mse_loss,
                    devices=["cuda:0", "cpu"])
    freed: List[int] = []
    original = released.release

    def counting(tensors: List[Tensor]) -> None:
        freed.extend(t.numel() for t in tensors)
        original(tensors)

    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("torchpipe.runtime.transport.release", counting)
        loss = pipe.step(x, y)
    assert freed == [8 * 256] * 4
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    for p, q in zip(plain.parameters(), pipe.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5)
