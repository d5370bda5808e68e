"""torchpipe.compiling: each layer compiled in place, one graph per traced layer, plain keys, eager's numbers.

A counting backend (dynamo hands it each graph; it counts them and their operators, then runs them, with
``aot_eager`` where forward and backward should go through AOT autograd as under inductor, with no C++ compiler
needed) says how many graphs were captured; dynamo's counters say how many graph breaks it met.
"""
import copy
import pickle
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

import torchpipe
from torchpipe import GPipe
from torchpipe.compiling import compile_layers, compile_options
from torchpipe.sequential import TracedLayer
from torchpipe.skip import pop, skippable, stash

dynamo = pytest.importorskip("torch._dynamo")
if not dynamo.is_dynamo_supported():
    pytest.skip("torch.compile does not work with this Python and PyTorch", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402 - after the skip: dynamo may not work here


class Counting:
    """A torch.compile backend that counts the graphs and operators it gets and runs them (``aot_eager``: through
    AOT autograd; else as dynamo captured them, which compiles faster)."""

    def __init__(self, aot_eager: bool = False) -> None:
        self.graphs = 0
        self.ops: List[int] = []
        self.run = dynamo.lookup_backend("aot_eager") if aot_eager else None

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        self.graphs += 1
        self.ops.append(sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")))
        return gm.forward if self.run is None else self.run(gm, example_inputs)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def gradients(module: nn.Module) -> List[Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_close(expected: List[Tensor], actual: List[Tensor]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)


# --- options --------------------------------------------------------------------------------------


def test_options_true_false_and_dicts() -> None:
    assert compile_options(True) == {}
    assert compile_options(False) is None
    given = {"backend": "aot_eager", "dynamic": None, "fullgraph": True}
    checked = compile_options(given)
    assert checked == given and checked is not given


@pytest.mark.parametrize(
    "options, error, words",
    [
        ("inductor", TypeError, "{'backend': 'inductor'}"),
        (1, TypeError, "True, False or a dict"),
        (None, TypeError, "True, False or a dict"),
        ({"fullgrahp": True}, ValueError, "'fullgrahp', which torch.compile does not take"),
        ({"fullgraph": "yes"}, TypeError, "fullgraph takes a bool"),
        ({"dynamic": 0}, TypeError, "dynamic takes True, False or None"),
        ({"backend": 3}, TypeError, "backend takes a backend's name or a callable"),
        ({"backend": "no-such-backend"}, ValueError, "no-such-backend"),
        ({"mode": "fastest"}, ValueError, "fastest"),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, ValueError, "mode"),
    ],
)
def test_bad_options_are_clear_errors(options: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=None) as raised:
        compile_layers(nn.Sequential(nn.Linear(2, 2)), options)
    assert words in str(raised.value)


def test_compile_layers_takes_a_sequential() -> None:
    with pytest.raises(TypeError, match="as_sequential"):
        compile_layers(nn.Linear(2, 2), True)  # type: ignore[arg-type]


def test_false_compiles_nothing() -> None:
    seq = nn.Sequential(nn.Linear(2, 2))
    compile_layers(seq, False)
    seq(torch.rand(3, 2))
    assert counters["stats"]["unique_graphs"] == 0


# --- blocks written by the user -------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def blocks() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), Block(8), Block(8), nn.Linear(8, 3)).double()


def test_user_blocks_compile_in_place_with_plain_keys() -> None:
    seq = blocks()
    eager = copy.deepcopy(seq)
    keys = list(seq.state_dict())
    backend = Counting(aot_eager=True)
    compile_layers(seq, {"backend": backend})
    assert list(seq.state_dict()) == keys
    assert [type(m) for m in seq] == [nn.Linear, Block, Block, nn.Linear]

    x = torch.randn(6, 4, dtype=torch.double)
    seq(x).pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    assert backend.graphs == len(seq) and graph_breaks() == 0
    torch.testing.assert_close(seq(x), eager(x))
    assert_close(gradients(eager), gradients(seq))
    eager.load_state_dict(seq.state_dict())  # a checkpoint of the compiled stage loads into the plain one


def test_user_blocks_in_gpipe_equal_eager() -> None:
    seq = blocks()
    eager = copy.deepcopy(seq)
    compile_layers(seq, {"backend": "aot_eager"})
    x = torch.randn(7, 4, dtype=torch.double)  # micro-batches of 3, 2 and 2
    for module in (seq, eager):
        GPipe(module, [2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="always")(x).pow(2).sum().backward()
    assert_close(gradients(eager), gradients(seq))


@skippable(stash=["skip"])
class Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        yield stash("skip", x)
        return torch.relu(self.linear(x))


@skippable(pop=["skip"])
class Pop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        return self.linear(x) + skip


def test_skippable_user_layers_keep_their_skips_eager() -> None:
    seq = nn.Sequential(Stash(), nn.Linear(4, 4), Pop()).double()
    eager = copy.deepcopy(seq)
    backend = Counting()
    compile_layers(seq, {"backend": backend})
    x = torch.randn(6, 4, dtype=torch.double)
    torch.testing.assert_close(seq(x), eager(x))
    for module in (seq, eager):
        GPipe(module, [2, 1], devices=["cpu", "cpu"], chunks=3)(x).sum().backward()
    assert_close(gradients(eager), gradients(seq))
    assert backend.graphs >= 3 and graph_breaks() == 0  # the Linears, the skippable layers' ones included


# --- layers of as_sequential: a Hugging Face Llama, traced by torch.export ----------------------------


#: Layers of transformer blocks, as one compiles each block (the default cut, a layer per linear layer, compiles
#: the same way, to more and smaller graphs); the first block's attention and MLP apart, so that the position
#: embeddings skip over the MLP to the second block as stashes and pops.
BLOCKS = ["model.layers.0", "model.layers.0.mlp", "model.layers.1", "model.norm", "lm_head"]


@pytest.fixture(scope="module")
def llama() -> nn.Sequential:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    example = torch.randint(1, 32, (2, 8))
    return torchpipe.as_sequential(model, input_ids=example, use_cache=False, output="logits", split_points=BLOCKS)


def test_each_traced_layer_compiles_to_one_graph(llama: nn.Sequential) -> None:
    seq = copy.deepcopy(llama)
    eager = copy.deepcopy(llama)
    keys = list(seq.state_dict())
    backend = Counting(aot_eager=True)
    compile_layers(seq, {"backend": backend, "fullgraph": True})  # fullgraph: a graph break would be an error
    assert list(seq.state_dict()) == keys
    assert [layer.name for layer in seq] == ["LlamaForCausalLM"] + BLOCKS
    assert all(isinstance(layer, TracedLayer) for layer in seq) and seq[1]._stashes and seq[3]._pops

    ids = torch.randint(1, 32, (4, 8))

    def layer_by_layer() -> Tensor:  # the skips of layers called by hand live in the caller's frame
        value: Any = ids
        for k, layer in enumerate(seq):
            before = backend.graphs
            value = layer(value)
            assert backend.graphs == before + 1, f"layer {k} ({layer.name}) made {backend.graphs - before} graphs"
        return value  # type: ignore[no-any-return]

    logits = layer_by_layer()
    assert graph_breaks() == 0
    assert all(ops > 0 for ops in backend.ops)
    expected = eager(ids)
    torch.testing.assert_close(logits, expected)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(expected.flatten(0, 1), ids.flatten()).backward()
    assert_close(gradients(eager), gradients(seq))

    # Other micro-batch sizes run the graphs compiled first: dimension 0 is dynamic.
    for size in (3, 5, 2):
        other = torch.randint(1, 32, (size, 8))
        torch.testing.assert_close(seq(other), eager(other))
    assert backend.graphs == len(seq)
    assert graph_breaks() == 0


def test_traced_layers_in_a_pipeline_equal_eager(llama: nn.Sequential) -> None:
    seq = copy.deepcopy(llama)
    eager = copy.deepcopy(llama)
    backend = Counting()
    compile_layers(seq, {"backend": backend})
    pipes = [GPipe(module, [3, 3], devices=["cpu", "cpu"], chunks=3, checkpoint="never") for module in (seq, eager)]

    def step(size: int) -> None:
        ids = torch.randint(1, 32, (size, 8))
        losses = []
        for pipe in pipes:
            pipe.zero_grad()
            loss = F.cross_entropy(pipe(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        assert_close(gradients(eager), gradients(seq))

    step(6)
    graphs = backend.graphs
    assert graphs <= 2 * len(seq)  # at most two per layer (an input's storage offset: 0, then others)
    for size in (9, 8):  # micro-batches of 3 and of (3, 3, 2): the graphs compiled already
        step(size)
    assert backend.graphs == graphs
    assert graph_breaks() == 0

    seq.eval()
    eager.eval()
    ids = torch.randint(1, 32, (4, 8))
    with torch.no_grad():  # the other mode's graphs
        torch.testing.assert_close(seq(ids), eager(ids))


def test_copies_of_compiled_layers_are_compiled(llama: nn.Sequential) -> None:
    seq = copy.deepcopy(llama)
    compile_layers(seq, {"backend": "eager"})
    for copied in (copy.deepcopy(seq), pickle.loads(pickle.dumps(seq[1]))):
        layers = copied if isinstance(copied, nn.Sequential) else [copied]
        assert all(layer._compile_options == {"backend": "eager"} for layer in layers)
    copy.deepcopy(seq)(torch.randint(1, 32, (2, 8)))
    assert counters["stats"]["unique_graphs"] == len(seq)


# --- random numbers ---------------------------------------------------------------------------------


class Noisy(nn.Module):
    """Dropout in a traced layer's own code (a function call, not a module), layers that draw nothing, a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 8)
        self.third = nn.Linear(8, 8)
        self.fourth = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        x = F.dropout(self.first(x), 0.5, self.training)
        return self.fourth(self.third(torch.tanh(self.second(x)))) + x  # x skips over two layers


def test_a_layer_that_draws_replays_its_draws_in_a_pipeline() -> None:
    model = Noisy().double()
    seq = torchpipe.as_sequential(model, torch.randn(2, 4, dtype=torch.double))
    draws: Dict[str, bool] = {layer.name: layer.torchpipe_draws_random for layer in seq}
    assert any(draws.values()) and not all(draws.values()), draws
    assert any(layer._stashes for layer in seq)
    eager = copy.deepcopy(seq)
    backend = Counting(aot_eager=True)
    compile_layers(seq, {"backend": backend})
    x = torch.randn(6, 4, dtype=torch.double)
    for module in (seq, eager):
        torch.manual_seed(1)
        GPipe(module, [1, len(seq) - 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")(x).sum().backward()
    # The recomputation drew what the forward drew, and the same numbers as the eager pipeline.
    assert_close(gradients(eager), gradients(seq))
    assert backend.graphs >= sum(not d for d in draws.values()) and graph_breaks() == 0
