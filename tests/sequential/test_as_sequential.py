"""torchpipe.as_sequential: the Sequential computes what the module computes, with the module's own parameters."""
import copy
import io
import pickle
from typing import Any, Callable, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from tests.sequential.models import BasicBlock, Encoder, ResidualNet, TwoInTwoOut, UNet
from torchpipe.sequential import TracedLayer, UntraceableError
from torchpipe.skip import verify_skippables
from torchpipe.skip.skippable import Skippable
from torchpipe.transfer import record_transfers
from torchpipe_balancing import balance_by_size, balance_by_time


def torchvision_or_skip() -> Any:
    try:
        import torchvision  # type: ignore[import-untyped]
    except Exception as error:  # noqa: BLE001 - a CUDA build beside a CPU torch fails with RuntimeError too
        pytest.skip(f"torchvision is not usable here ({type(error).__name__}: {error})")
    return torchvision


def padding_mask(batch: int, length: int) -> Tensor:
    """True at padded positions; every sequence keeps at least one token."""
    lengths = torch.randint(1, length + 1, (batch,))
    return torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)


#: name -> (module builder, example arguments builder)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Tuple[Tensor, ...]]]] = {
    "residual": (lambda: ResidualNet(norm=nn.BatchNorm2d), lambda: (torch.randn(4, 3, 8, 8),)),
    "unet": (UNet, lambda: (torch.randn(3, 3, 8, 8),)),
    "encoder": (Encoder, lambda: (torch.randint(0, 20, (4, 6)), padding_mask(4, 6))),
    "two-in-two-out": (TwoInTwoOut, lambda: (torch.randn(5, 6), torch.randn(5, 6))),
}


def flat(output: Any) -> List[Tensor]:
    return [output] if isinstance(output, Tensor) else list(output)


def as_input(args: Sequence[Tensor]) -> Any:
    return args[0] if len(args) == 1 else tuple(args)


def assert_same_outputs(expected: Any, actual: Any) -> None:
    assert type(actual) is type(expected)
    for e, a in zip(flat(expected), flat(actual)):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert torch.allclose(a, e, atol=1e-6)


# --- outputs and parameters --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_sequential_computes_what_the_module_computes(name: str) -> None:
    build, example = MODELS[name]
    module, args = build(), example()
    seq = torchpipe.as_sequential(module, *args)
    assert type(seq) is nn.Sequential and len(seq) > 1
    assert all(isinstance(layer, TracedLayer) for layer in seq)
    assert_same_outputs(module(*args), seq(as_input(args)))
    other = example()  # another batch, of another size
    other = tuple(t[:2] for t in other)
    assert_same_outputs(module(*other), seq(as_input(other)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameters_and_buffers_are_the_modules_own(name: str) -> None:
    build, example = MODELS[name]
    module = build()
    seq = torchpipe.as_sequential(module, *example())
    assert {id(p) for p in seq.parameters()} == {id(p) for p in module.parameters()}
    assert {id(b) for b in seq.buffers()} >= {id(b) for b in module.buffers()}
    assert sum(1 for _ in seq.parameters()) == sum(1 for _ in module.parameters())


def test_training_the_sequential_trains_the_module() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    x = torch.randn(4, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    before = copy.deepcopy(module.state_dict())
    optimizer = torch.optim.SGD(seq.parameters(), lr=0.1)
    F.cross_entropy(seq(x), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    after = module.state_dict()
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert not torch.equal(after["bn1.running_mean"], before["bn1.running_mean"])  # BatchNorm ran in the layers
    assert int(after["bn1.num_batches_tracked"]) == 1


def test_state_dict_keys_are_the_modules_behind_the_layer_index() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    seq = torchpipe.as_sequential(module, torch.randn(2, 3, 8, 8))
    keys = [key.split(".", 1)[1] for key in seq.state_dict()]
    assert sorted(keys) == sorted(module.state_dict())
    # And the module's state dict loads into a fresh copy of the Sequential by those keys.
    fresh = ResidualNet(norm=nn.BatchNorm2d)
    fresh_seq = torchpipe.as_sequential(fresh, torch.randn(2, 3, 8, 8))
    fresh_seq.load_state_dict(seq.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in module.state_dict().items())


def test_tracing_leaves_the_module_its_buffers_and_the_random_stream_as_they_were() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    state = copy.deepcopy(module.state_dict())
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    torchpipe.as_sequential(module, x)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())
    assert module.training and not hasattr(module, "_tensor_constant0")


def test_train_and_eval_reach_the_modules_in_the_layers() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d)
    x = torch.randn(4, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    seq(x)  # running statistics move away from their initial values
    seq.eval()
    assert not module.bn1.training
    assert_same_outputs(module(x), seq(x))


# --- layers ------------------------------------------------------------------------------------


def test_one_layer_per_call_of_a_submodule_that_holds_parameters() -> None:
    module = ResidualNet()
    seq = torchpipe.as_sequential(module, torch.randn(2, 3, 8, 8))
    block = ["conv1", "bn1", "conv2", "bn2"]
    expected = ["conv1", "bn1"]
    expected += [f"layer1.{b}.{n}" for b in range(2) for n in block]
    expected += [f"layer2.0.{n}" for n in block] + ["layer2.0.downsample.0", "layer2.0.downsample.1"]
    expected += [f"layer2.1.{n}" for n in block] + ["fc"]
    assert [layer.name for layer in seq] == expected


def test_the_function_calls_around_a_submodule_are_folded_into_its_layer() -> None:
    seq = torchpipe.as_sequential(ResidualNet(), torch.randn(2, 3, 8, 8))
    layers = {layer.name: layer for layer in seq}
    assert "relu" in layers["bn1"].code and "flatten" in layers["layer2.1.bn2"].code
    assert "+" in layers["layer1.0.bn2"].code  # the residual add, after the block's last norm


def skip_ends(seq: nn.Sequential) -> Tuple[Dict[str, int], Dict[str, int]]:
    stashed: Dict[str, int] = {}
    popped: Dict[str, int] = {}
    for k, layer in enumerate(seq):
        for _, name in layer.stashed():
            assert name not in stashed, f"{name} stashed twice"
            stashed[name] = k
        for _, name in layer.popped():
            assert name not in popped, f"{name} popped twice"
            popped[name] = k
    return stashed, popped


@pytest.mark.parametrize("name", sorted(MODELS))
def test_skips_are_verified_unique_and_jump_over_at_least_one_layer(name: str) -> None:
    build, example = MODELS[name]
    seq = torchpipe.as_sequential(build(), *example())
    verify_skippables(seq)
    stashed, popped = skip_ends(seq)
    assert set(stashed) == set(popped)
    assert all(popped[n] > stashed[n] + 1 for n in stashed)
    namespaces = {ns for layer in seq for ns, _ in layer.stashed() + layer.popped()}
    assert len(namespaces) <= 1


def test_the_residual_input_of_a_block_is_a_skip() -> None:
    seq = torchpipe.as_sequential(ResidualNet(), torch.randn(2, 3, 8, 8))
    names = [layer.name for layer in seq]
    stashed, popped = skip_ends(seq)
    ends = sorted((names[stashed[n]], names[popped[n]]) for n in stashed)
    # A block's input goes to its first convolution, which stashes it for the residual add at the end of the
    # block (so at a partition boundary before the block it crosses once, not twice).
    assert ("layer1.0.conv1", "layer1.0.bn2") in ends
    assert ("layer2.0.conv1", "layer2.0.downsample.0") in ends  # the downsample reads the block's input


def test_a_tensor_used_by_the_next_layer_and_a_later_one_crosses_a_partition_boundary_once() -> None:
    module = ResidualNet()
    x = torch.randn(4, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    names = [layer.name for layer in seq]
    first = names.index("layer1.0.conv1")  # its input is the block's input, also used by layer1.0.bn2
    piped = torchpipe.GPipe(seq, [first, len(seq) - first], devices=["cpu", "cpu"], chunks=2)
    with record_transfers() as log:
        piped(x).sum().backward()
    assert sorted({r.kind for r in log}) == ["activation", "gradient"]


def test_each_layer_passes_on_only_what_later_layers_need() -> None:
    seq = torchpipe.as_sequential(UNet(), torch.randn(2, 3, 8, 8))
    for layer, following in zip(seq, list(seq)[1:]):
        assert layer._carried == len(following._received)
        inputs = [n for n in following._graph.nodes if n.op == "placeholder"]
        # Every value handed over is used by the next layer's code, or relayed by it to a later layer.
        assert all(node.users for node in inputs)


def test_a_two_input_two_output_module_takes_and_returns_tuples() -> None:
    module = TwoInTwoOut()
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    seq = torchpipe.as_sequential(module, x, y)
    out = seq((x, y))
    assert isinstance(out, tuple) and len(out) == 2
    with pytest.raises(TypeError, match="takes a tuple of 2 tensors"):
        seq(x)


def test_a_single_output_tuple_stays_a_tuple() -> None:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tuple[Tensor]:
            return (self.linear(x),)

    out = torchpipe.as_sequential(One(), torch.randn(2, 3))(torch.randn(2, 3))
    assert isinstance(out, tuple) and len(out) == 1


# --- split points and leaf modules -------------------------------------------------------------


def test_split_points_cut_coarser() -> None:
    module = ResidualNet()
    x = torch.randn(2, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x, split_points=["layer1", "layer2.0", "layer2.1", "fc"])
    assert [layer.name for layer in seq] == ["conv1", "layer1", "layer2.0", "layer2.1", "fc"]
    assert_same_outputs(module(x), seq(x))
    fine = torchpipe.as_sequential(module, x)
    assert len(fine) > len(seq)


def test_split_points_must_be_called_submodules() -> None:
    module = ResidualNet()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="'layer9'"):
        torchpipe.as_sequential(module, x, split_points=["layer9"])
    with pytest.raises(ValueError, match="inside 'layer1.0', which is kept whole"):
        torchpipe.as_sequential(module, x, split_points=["layer1.0.conv2"], leaf_modules=["layer1.0"])
    with pytest.raises(TypeError, match=r"write \['layer1'\]"):
        torchpipe.as_sequential(module, x, split_points="layer1")


def test_leaf_modules_keep_a_submodule_whole() -> None:
    module = ResidualNet()
    x = torch.randn(2, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x, leaf_modules=["layer1.0"])
    names = [layer.name for layer in seq]
    assert "layer1.0" in names and not any(n.startswith("layer1.0.") for n in names)
    assert_same_outputs(module(x), seq(x))
    by_class = torchpipe.as_sequential(module, x, leaf_modules=[BasicBlock])
    assert [layer.name for layer in by_class] == ["conv1", "bn1", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"]
    with pytest.raises(ValueError, match="'nope'"):
        torchpipe.as_sequential(module, x, leaf_modules=["nope"])


def test_transformer_encoder_stacks_are_cut_per_encoder_layer() -> None:
    module = Encoder(depth=4)
    seq = torchpipe.as_sequential(module, torch.randint(0, 20, (2, 5)), padding_mask(2, 5))
    assert [layer.name for layer in seq] == ["embedding"] + [f"encoder.layers.{i}" for i in range(4)] + ["head"]


def test_a_whole_transformer_with_masks() -> None:
    module = nn.Transformer(8, 2, 2, 2, 16, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(3, 5, 8), torch.randn(3, 4, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = module

        def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
            return self.transformer(src, tgt, tgt_mask=causal.to(tgt.device), tgt_is_causal=True)

    model = Model()
    seq = torchpipe.as_sequential(model, src, tgt)
    assert [layer.name for layer in seq] == [
        f"transformer.{part}" for part in ["encoder.layers.0", "encoder.layers.1", "encoder.norm", "decoder.layers.0",
                                           "decoder.layers.1", "decoder.norm"]
    ]
    assert_same_outputs(model(src, tgt), seq((src, tgt)))


# --- values that are not tensors, in-place writes, shared parameters ---------------------------


class Sizes(nn.Module):
    """Uses the batch size, taken at the start, after several layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        batch = x.size(0)
        y = self.c(self.b(self.a(x)))
        return y.reshape(batch, 2, 4).sum(1)


def test_sizes_are_recomputed_where_they_are_used() -> None:
    module = Sizes()
    seq = torchpipe.as_sequential(module, torch.randn(3, 4))
    assert [layer.name for layer in seq] == ["a", "b", "c"]
    assert "size" in seq[2].code
    x = torch.randn(5, 4)
    assert_same_outputs(module(x), seq(x))


class Attention(nn.Module):
    """A module returning a tuple (nn.MultiheadAttention) whose parts are used by different layers."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.attention(x, x, x)
        y = self.a(out[0])
        return y + self.b(out[1]).mean()


def test_tuples_returned_by_a_submodule_are_unpacked_in_its_layer() -> None:
    module = Attention()
    x = torch.randn(2, 3, 4)
    seq = torchpipe.as_sequential(module, x)
    assert [layer.name for layer in seq] == ["attention", "a", "b"]
    assert_same_outputs(module(x), seq(x))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.middle = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)
        self.twice = nn.Linear(4, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.twice(self.middle(self.embedding(tokens)))
        x = self.twice(self.other(x))
        return x @ self.embedding.weight.t()


def test_a_module_called_twice_is_one_layer_and_a_tied_parameter_is_held_by_both_layers() -> None:
    module = Tied()
    tokens = torch.randint(0, 10, (2, 3))
    seq = torchpipe.as_sequential(module, tokens)
    # `twice` is called at two places: everything between its calls is one layer. The embedding's weight is
    # used again by the last matmul: both layers hold that very Parameter, under the name it has in the model.
    assert [layer.name for layer in seq] == ["embedding", "middle", "twice..twice"]
    assert seq[0].get_parameter("embedding.weight") is module.embedding.weight
    assert seq[2].get_parameter("embedding.weight") is module.embedding.weight
    assert {id(p) for p in seq.parameters()} == {id(p) for p in module.parameters()}
    assert_same_outputs(module(tokens), seq(tokens))
    expected = torch.autograd.grad(module(tokens).sum(), list(module.parameters()))
    actual = torch.autograd.grad(seq(tokens).sum(), list(module.parameters()))
    assert all(torch.allclose(e, a) for e, a in zip(expected, actual))
    coarse = torchpipe.as_sequential(module, tokens, split_points=["middle", "other"])
    assert [layer.name for layer in coarse] == ["embedding", "middle..other"]


class WritesItsInput(nn.Module):
    """ReLU(inplace=True) on the previous layer's output, which is also read later."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        z = self.act(y)  # writes y: the module's y is relu(a(x)) from here on
        return self.c(self.b(z)) + y


def test_a_layer_never_writes_a_tensor_it_received() -> None:
    module = WritesItsInput()
    x = torch.randn(3, 4)
    seq = torchpipe.as_sequential(module, x, split_points=["act", "b", "c"])
    # `act` writes what it received from `a`, and `c`'s layer reads it after: they are one layer.
    assert [layer.name for layer in seq] == ["a", "act..c"]
    assert "clone" in seq[1].code
    assert_same_outputs(module(x), seq(x))


def test_writing_the_input_in_place_leaves_the_callers_tensor_alone() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            x.mul_(2)
            return self.linear(x)

    module = Scale()
    x = torch.randn(2, 3)
    seq = torchpipe.as_sequential(module, x.clone())
    kept = x.clone()
    out = seq(x)
    assert torch.equal(x, kept)
    assert_same_outputs(module(x.clone()), out)


def test_arguments_that_are_not_tensors_are_fixed_at_their_example_values() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: Tensor, scale: float, mask: Any = None, shift: Tensor = None) -> Tensor:  # type: ignore[assignment]
            y = self.linear(x) * scale
            if mask is not None:
                y = y.masked_fill(mask, 0.0)
            return y if shift is None else y + shift

    module = Scaled()
    x, shift = torch.randn(2, 3), torch.randn(2, 3)
    seq = torchpipe.as_sequential(module, x, 3.0)
    assert_same_outputs(module(x, 3.0), seq(x))
    with_shift = torchpipe.as_sequential(module, x, 0.5, None, shift)
    assert_same_outputs(module(x, 0.5, None, shift), with_shift((x, shift)))


# --- errors ------------------------------------------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return self.linear(x)
        return -x


class HasDataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.gate = DataDependent()

    def forward(self, x: Tensor) -> Tensor:
        return self.gate(self.first(x))


def test_untraceable_code_is_a_clear_error_naming_the_submodule_and_the_line() -> None:
    with pytest.raises(UntraceableError) as error:
        torchpipe.as_sequential(HasDataDependent(), torch.randn(2, 4))
    message = str(error.value)
    assert "'gate' (DataDependent)" in message
    assert "if x.sum() > 0:" in message and f"{__file__}:" in message
    assert "leaf_modules=['gate']" in message
    assert isinstance(error.value, ValueError) and isinstance(error.value, RuntimeError)
    # As the message says: keep it whole.
    module = HasDataDependent()
    x = torch.randn(2, 4)
    seq = torchpipe.as_sequential(module, x, leaf_modules=["gate"])
    assert [layer.name for layer in seq] == ["first", "gate"]
    assert_same_outputs(module(x), seq(x))


def test_untraceable_code_in_the_module_itself() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            for _ in range(x.size(0)):
                x = self.linear(x)
            return x

    with pytest.raises(UntraceableError, match="Loop.forward") as error:
        torchpipe.as_sequential(Loop(), torch.randn(2, 4), tracer="fx")
    assert "for _ in range(x.size(0)):" in str(error.value) and "torch.fx.wrap" in str(error.value)
    # Without tracer='fx', torch.export traces it for the example's batch size, and only that one.
    module = Loop()
    seq = torchpipe.as_sequential(module, torch.randn(2, 4))
    x = torch.randn(2, 4)
    assert_same_outputs(module(x), seq(x))
    with pytest.raises(ValueError, match=r"x.shape\[0\] is 3 but the graph holds for 2 only"):
        seq(torch.randn(3, 4))


class Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        y = self.linear(x)
        if self.kind == "dict":
            return {"out": y}
        if self.kind == "list":
            return [y, y]
        return y, x.size(0)


@pytest.mark.parametrize(
    "kind, described", [("dict", "a dict"), ("list", "a list"), ("int", r"a tuple \(Tensor, int\)")]
)
def test_outputs_that_are_not_tensors_are_a_type_error_saying_to_wrap_the_module(kind: str, described: str) -> None:
    with pytest.raises(TypeError, match=f"Returns.forward returns {described}; pass output=.*or wrap the module"):
        torchpipe.as_sequential(Returns(kind), torch.randn(2, 4))


def test_bad_arguments() -> None:
    module = TwoInTwoOut()
    with pytest.raises(TypeError, match="at least one tensor"):
        torchpipe.as_sequential(nn.Identity(), 3)
    with pytest.raises(TypeError, match="argument 0 is a list holding tensors"):
        torchpipe.as_sequential(nn.Identity(), [torch.randn(2)])
    with pytest.raises(TypeError, match="takes an nn.Module"):
        torchpipe.as_sequential(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="qualified names or nn.Module classes"):
        torchpipe.as_sequential(module, torch.randn(2, 6), torch.randn(2, 6), leaf_modules=[3])  # type: ignore[list-item]


# --- reading, copying, saving ------------------------------------------------------------------


def test_layers_have_a_readable_repr_and_code() -> None:
    seq = torchpipe.as_sequential(ResidualNet(), torch.randn(2, 3, 8, 8))
    text = repr(seq)
    assert "TracedLayer[layer1.0.conv1](" in text
    assert "(layer1.0.conv1): Conv2d(8, 8, kernel_size=(3, 3)" in text
    assert "stashes: relu (for layer 5)" in text and "pops: relu (from layer 2)" in text
    assert seq[0].code.startswith("def forward(self, input):\n    x = input")
    assert seq[2].get_submodule("layer1.0.conv1") is seq[2].layer1.get_submodule("0").conv1


def test_deepcopy_and_pickle() -> None:
    module = ResidualNet(norm=nn.BatchNorm2d).eval()
    x = torch.randn(2, 3, 8, 8)
    seq = torchpipe.as_sequential(module, x)
    copied = copy.deepcopy(seq)
    assert_same_outputs(seq(x), copied(x))
    assert not any(p is q for p, q in zip(seq.parameters(), copied.parameters()))
    loaded = pickle.loads(pickle.dumps(seq))
    assert_same_outputs(seq(x), loaded(x))
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    buffer.seek(0)
    assert_same_outputs(seq(x), torch.load(buffer, weights_only=False)(x))
    verify_skippables(nn.Sequential(*copied, *loaded[:0]))


def test_two_converted_models_in_one_sequential_do_not_mix_their_skips() -> None:
    first_module, second_module = ResidualNet(classes=3 * 8 * 8), ResidualNet()
    first = torchpipe.as_sequential(first_module, torch.randn(2, 3, 8, 8))
    second = torchpipe.as_sequential(second_module, torch.randn(2, 3, 8, 8))
    both = nn.Sequential(*first, nn.Unflatten(1, (3, 8, 8)), *second)
    verify_skippables(both)
    x = torch.randn(2, 3, 8, 8)
    assert_same_outputs(second_module(first_module(x).view(2, 3, 8, 8)), both(x))


def test_layers_are_skippable_modules() -> None:
    seq = torchpipe.as_sequential(ResidualNet(), torch.randn(2, 3, 8, 8))
    assert all(isinstance(layer, Skippable) for layer in seq)


# --- balancing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["residual", "unet"])
def test_the_balancers_work_on_the_result(name: str) -> None:
    build, example = MODELS[name]
    module = build()
    args = example()
    seq = torchpipe.as_sequential(module, *args)
    state = copy.deepcopy(module.state_dict())
    for balance in (balance_by_time(3, seq, as_input(args), timeout=0.1), balance_by_size(3, seq, as_input(args))):
        assert len(balance) == 3 and sum(balance) == len(seq) and min(balance) >= 1
        torchpipe.GPipe(seq, balance, devices=["cpu"] * 3)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())


# --- torchvision ---------------------------------------------------------------------------------


def test_torchvision_resnet18() -> None:
    torchvision = torchvision_or_skip()
    module = torchvision.models.resnet18(num_classes=7)
    x = torch.randn(2, 3, 32, 32)
    seq = torchpipe.as_sequential(module, x)
    assert len(seq) == 20 + 20 + 1  # convolutions, norms and the classifier
    assert {id(p) for p in seq.parameters()} == {id(p) for p in module.parameters()}
    assert_same_outputs(module(x), seq(x))
    balance = balance_by_time(3, seq, x, timeout=0.1)
    piped = torchpipe.GPipe(seq, balance, devices=["cpu"] * 3, chunks=1, checkpoint="always")
    reference = copy.deepcopy(module)
    assert_same_outputs(reference(x), piped(x))
