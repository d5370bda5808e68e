"""Which stage outputs a stage frees once sent ([Note: released outputs]): only those whose data nothing reads
again, and the backward from a freed output gives the gradients it would have given."""
import torch
from torch import nn

from torchpipe.runtime.release import LOOKED_AT, releasable, release


def test_a_linear_layers_output_is_released_and_its_backward_is_unchanged() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    grad = torch.randn(5, 3)
    expected = torch.autograd.grad(layer(x), [x, layer.weight], grad)
    out = layer(x)
    assert releasable([out]) == [out]
    release([out])
    assert out.untyped_storage().nbytes() == 0 and out.shape == (5, 3)  # the metadata stays
    got = torch.autograd.grad(out, [x, layer.weight], grad)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))  # the same computation, run twice


def test_an_output_its_own_backward_needs_is_kept() -> None:
    # ReLU, sigmoid and tanh compute their gradient from their result: freeing it would corrupt the gradient.
    x = torch.randn(5, 4, requires_grad=True)
    for make in (torch.relu, torch.sigmoid, torch.tanh, lambda t: (t * 2).relu_()):
        assert releasable([make(x)]) == []


def test_an_output_that_a_later_output_was_computed_from_is_kept() -> None:
    # A stage that returns (h, h * w): the second output's backward reads h.
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    h = x @ torch.randn(4, 4)
    later = h * w
    assert releasable([h, later]) == [later]
    assert releasable([later, h]) == [later]


def test_views_leaves_shared_storage_and_stashed_tensors_are_kept() -> None:
    x = torch.randn(5, 4, requires_grad=True)
    h = x * 3
    assert releasable([h.view(20)]) == []            # a view: its base may be read elsewhere
    assert releasable([x]) == []                     # a leaf (the stage's input passed on)
    assert releasable([h, h]) == []                  # two outputs of one storage
    assert releasable([h], others=[h]) == []         # also stashed as a skip, which may stay on this rank
    assert releasable([torch.randn(3)]) == []        # no graph: nothing holds it for a backward


def test_a_graph_too_large_to_look_at_keeps_its_outputs() -> None:
    x = torch.randn(3, requires_grad=True)
    first = x * 2
    second = x + 0
    for _ in range(LOOKED_AT):
        second = second + 1
    assert releasable([first, second]) == []


def test_in_one_process_an_output_goes_only_once_copied_off_a_gpu() -> None:
    # The transport's rule, with the devices the stages are said to be on (the tensors stay on the CPU): from a
    # GPU to another device the message is a copy the copy stream was recorded on; on one device, or from host
    # memory, the message is (or still reads) the output itself.
    from types import SimpleNamespace

    from torchpipe.runtime.transport import Edge, EdgeKind, LocalTransport

    layer = nn.Linear(4, 3)
    edge = Edge(EdgeKind.ACTIVATION, 0, 0, 1)
    for devices, freed in ((["cuda:0", "cpu"], True), (["cuda:0", "cuda:1"], True), (["cpu", "cpu"], False),
                           (["cpu", "cuda:0"], False), (["cuda:0", "cuda:0"], False)):
        transport = LocalTransport(SimpleNamespace(devices=[torch.device(d) for d in devices]), [])  # type: ignore[arg-type]
        out = layer(torch.randn(5, 4))
        transport.release(edge, [out], [])
        assert (out.untyped_storage().nbytes() == 0) is freed, devices
