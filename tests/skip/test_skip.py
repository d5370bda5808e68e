"""torchpipe.skip: stash/pop in plain Sequentials and across GPipe partitions, namespaces, verification."""
import copy
import gc
import pickle
import weakref
from typing import Any, Dict, List, Optional

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import torchpipe
from tests.models import cpu_gpipe, remember_and_recall, skippable_unet
from torchpipe import GPipe
from torchpipe.parallel import DataParallel
from torchpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from torchpipe.skip.namespace import DEFAULT
from torchpipe.transfer import record_transfers


@skippable(stash=["skip"])
class Stash(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x)
        yield stash("skip", y)
        return y.tanh()


@skippable(pop=["skip"])
class Pop(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.linear(x) * skip


def reference(model: nn.Sequential) -> nn.Sequential:
    """The same model, run plainly (skippable layers work in a plain Sequential)."""
    return copy.deepcopy(model)


def assert_transparent(model: nn.Sequential, balance: List[int], chunks: int, checkpoint: str, batch: int = 6) -> None:
    plain = reference(model)
    piped = GPipe(model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(batch, 4)
    x_plain, x_piped = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = plain(x_plain), piped(x_piped)
    assert torch.allclose(actual, expected, atol=1e-6)
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    assert torch.allclose(x_piped.grad, x_plain.grad, atol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(q.grad, p.grad, atol=1e-5), name


def test_skippable_layers_work_in_a_plain_sequential() -> None:
    stash_layer, pop_layer = Stash(), Pop()
    model = nn.Sequential(stash_layer, nn.Linear(4, 4), pop_layer)
    x = torch.randn(3, 4)
    y = stash_layer.linear(x)
    expected = pop_layer.linear(model[1](y.tanh())) * y
    assert torch.allclose(model(x), expected)


def test_skippable_class_keeps_its_name_and_is_a_module() -> None:
    layer = Stash()
    assert type(layer).__name__ == "Stash"
    assert isinstance(layer, nn.Module)
    assert type(layer).stashable_names == frozenset({"skip"})


def test_skippable_layer_prints_as_torchgpipe_prints_it() -> None:
    """torchgpipe 0.0.7 prints a skippable layer as ``@skippable(Layer(...))``; torchpipe printed it as a
    plain module, so nothing told a skippable layer from the class it decorates."""

    @skippable(stash=["hello"])
    class Hello(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("hello", x)
            return self.conv(x)

    assert repr(Hello()) == "@skippable(Hello(\n  (conv): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))\n))"
    assert "(0): @skippable(Hello(" in repr(nn.Sequential(Hello()))


@given(
    before=st.integers(0, 2),
    between=st.integers(0, 4),
    after=st.integers(0, 2),
    chunks=st.integers(1, 4),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
    data=st.data(),
)
def test_long_skips_are_transparent(
    before: int, between: int, after: int, chunks: int, checkpoint: str, data: st.DataObject
) -> None:
    layers: List[nn.Module] = [nn.Linear(4, 4) for _ in range(before)]
    layers += [Stash()] + [nn.Linear(4, 4) for _ in range(between)] + [Pop()]
    layers += [nn.Linear(4, 4) for _ in range(after)]
    n = len(layers)
    partitions = data.draw(st.integers(1, min(4, n)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=partitions - 1, max_size=partitions - 1)))
    edges = [0, *cuts, n]
    balance = [b - a for a, b in zip(edges, edges[1:])]
    assert_transparent(nn.Sequential(*layers), balance, chunks, checkpoint)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 1, 1, 1, 1], [2, 3], [1, 4], [4, 1], [5]])
def test_skip_over_partitions(checkpoint: str, balance: List[int]) -> None:
    model = nn.Sequential(Stash(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), Pop())
    assert_transparent(model, balance, chunks=3, checkpoint=checkpoint)


def test_skip_tensor_moves_only_between_the_stash_and_pop_partitions() -> None:
    model = nn.Sequential(Stash(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), Pop())
    piped = GPipe(model, [1, 1, 2, 1], devices=["cpu"] * 4, chunks=2)
    with record_transfers() as log:
        piped(torch.randn(4, 4, requires_grad=True)).sum().backward()
    skips = [r for r in log if r.kind == "skip"]
    skip_grads = [r for r in log if r.kind == "skip-gradient"]
    assert sorted((r.source, r.target, r.microbatch, r.name) for r in skips) == [(0, 3, 0, "skip"), (0, 3, 1, "skip")]
    assert sorted((r.source, r.target, r.microbatch) for r in skip_grads) == [(3, 0, 0), (3, 0, 1)]
    # The main path carries one (2, 4) float32 tensor per hand-over: never the skip too.
    main = [r for r in log if r.kind in ("activation", "gradient")]
    assert main and all(r.nbytes == 2 * 4 * 4 for r in main)
    assert all(abs(r.source - r.target) == 1 for r in main)


def test_skip_within_one_partition_is_not_handed_over() -> None:
    model = nn.Sequential(Stash(), nn.Linear(4, 4), Pop(), nn.Linear(4, 4))
    piped = GPipe(model, [3, 1], devices=["cpu"] * 2, chunks=2)
    with record_transfers() as log:
        piped(torch.randn(4, 4)).sum().backward()
    assert not [r for r in log if r.kind.startswith("skip")]
    assert_transparent(nn.Sequential(Stash(), nn.Linear(4, 4), Pop(), nn.Linear(4, 4)), [3, 1], 2, "always")


# --- namespaces ----------------------------------------------------------------------------------


def test_the_same_classes_twice_with_namespaces() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        Stash().isolate(ns1), nn.Linear(4, 4), Pop().isolate(ns1), Stash().isolate(ns2), nn.Linear(4, 4),
        Pop().isolate(ns2),
    )
    verify_skippables(model)
    for checkpoint in ("always", "never"):
        assert_transparent(copy.deepcopy(model), [2, 2, 2], chunks=2, checkpoint=checkpoint)


def test_nested_namespaces_cross_each_other() -> None:
    # Two skips whose spans overlap: stash a, stash b, pop a, pop b.
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns1), Pop().isolate(ns2))
    assert_transparent(model, [1, 1, 1, 1], chunks=3, checkpoint="except_last")


def test_missing_isolate_is_reported() -> None:
    model = nn.Sequential(Stash(), Pop(), Stash(), Pop())
    with pytest.raises(TypeError, match="stashed twice") as info:
        verify_skippables(model)
    assert "isolate" in str(info.value)
    assert "popped twice" in str(info.value)


def test_isolate_only_some_names() -> None:
    @skippable(stash=["a", "b"])
    class StashTwo(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("a", x)
            yield stash("b", x * 2)
            return x

    @skippable(pop=["a", "b"])
    class PopTwo(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            a = yield pop("a")
            b = yield pop("b")
            return x + a + b

    ns = Namespace()
    model = nn.Sequential(StashTwo().isolate(ns, only=["a"]), PopTwo().isolate(ns, only=["a"]))
    verify_skippables(model)
    assert torch.allclose(model(torch.ones(2, 1)), torch.full((2, 1), 4.0))
    with pytest.raises(ValueError, match="no skip names"):
        StashTwo().isolate(ns, only=["c"])


def test_namespace_copies_are_equal_to_it() -> None:
    """A Namespace compared by identity: ``copy.copy(ns) == ns`` was False (torchgpipe 0.0.7 says True), so
    layers deep-copied one by one no longer paired their stash with their pop."""
    ns = Namespace()
    assert copy.copy(ns) == ns and copy.copy(ns) is not ns
    assert copy.deepcopy(ns) == ns and hash(copy.deepcopy(ns)) == hash(ns)
    assert pickle.loads(pickle.dumps(ns)) == ns
    assert pickle.loads(pickle.dumps(DEFAULT)) == DEFAULT
    assert Namespace() != ns and ns != DEFAULT
    assert ns != "not a namespace"

    stash_layer, pop_layer = Stash(4).isolate(ns), Pop(4).isolate(ns)
    copied = nn.Sequential(copy.deepcopy(stash_layer), nn.Linear(4, 4), copy.deepcopy(pop_layer))
    verify_skippables(copied)
    pickled = pickle.loads(pickle.dumps(nn.Sequential(stash_layer, nn.Linear(4, 4), pop_layer)))
    verify_skippables(pickled)


def test_deepcopied_model_with_isolated_namespaces_still_verifies_and_routes() -> None:
    """``copy.deepcopy(model)`` of a model with isolated namespaces must pass verify_skippables and route
    each skip to its own pop inside GPipe, with the outputs of the original."""
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        Stash(4).isolate(ns1), Stash(4).isolate(ns2), nn.Linear(4, 4), Pop(4).isolate(ns2), Pop(4).isolate(ns1)
    )
    copied = copy.deepcopy(model)
    verify_skippables(copied)
    x = torch.randn(6, 4)
    expected = model(x)
    piped = GPipe(copied, [2, 1, 2], devices=["cpu"] * 3, chunks=3)
    torch.testing.assert_close(piped(x), expected)


def test_two_namespaces_never_print_alike() -> None:
    """Namespaces printed as a per-process counter, ``Namespace(3)``: a copy printed like its original
    while comparing unequal, and namespaces from two processes printed alike."""
    spaces = [Namespace() for _ in range(100)]
    assert len({repr(ns) for ns in spaces}) == 100
    assert repr(copy.deepcopy(spaces[0])) == repr(spaces[0])
    assert repr(DEFAULT) not in {repr(ns) for ns in spaces}


# --- verification --------------------------------------------------------------------------------


def test_verify_skippables_lists_every_problem_at_once() -> None:
    @skippable(stash=["lonely"])
    class StashLonely(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("lonely", x)
            return x

    @skippable(pop=["ghost"])
    class PopGhost(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            ghost = yield pop("ghost")
            return x + ghost

    model = nn.Sequential(StashLonely(), PopGhost(), nn.Identity())
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    message = str(info.value)
    assert "2 problems" in message
    assert "'lonely'" in message and "no later layer pops" in message and "layer 0" in message
    assert "'ghost'" in message and "no earlier layer stashes" in message and "layer 1" in message
    with pytest.raises(TypeError, match="2 problems"):
        GPipe(model, [1, 2], devices=["cpu", "cpu"])


def test_pop_before_stash_is_reported() -> None:
    with pytest.raises(TypeError, match="no earlier layer stashes"):
        verify_skippables(nn.Sequential(Pop(), Stash()))


def test_undeclared_names_and_bad_yields_are_clear_errors() -> None:
    @skippable(stash=["a"])
    class Wrong(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("b", x)
            return x

    @skippable()
    class Weird(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield 42
            return x

    with pytest.raises(RuntimeError, match="does not declare"):
        Wrong()(torch.zeros(1))
    with pytest.raises(TypeError, match="yields only"):
        Weird()(torch.zeros(1))
    with pytest.raises(TypeError, match="takes a Tensor or None"):
        stash("a", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of names"):
        skippable(stash="skip")  # type: ignore[arg-type]



@skippable(stash=["foo"])
class StashesFoo(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("foo", x)
        return x * 2


@skippable(pop=["foo"])
class PopsFoo(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        foo = yield pop("foo")
        return x + foo


@pytest.mark.parametrize("generator", [True, False])
@pytest.mark.parametrize("where", ["alone", "plain", "gpipe"])
def test_a_declared_skip_a_forward_leaves_unused_is_a_runtime_error(where: str, generator: bool) -> None:
    # Issue 15: torchgpipe (and fairscale's ported suite) raise "'foo' must be stashed but have not" when a
    # layer declared @skippable(stash=['foo']) returns without stashing it, and likewise for pop; torchpipe
    # said nothing outside a pipeline. The layer itself raises now, naming itself and the skip, also when
    # its forward is not a generator at all, alone, in a plain Sequential and in a GPipe.
    @skippable(stash=["foo"])
    class Keeps(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            if generator:
                yield from ()
            return x * 2

    @skippable(pop=["foo"])
    class Takes(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            if generator:
                yield from ()
            return x * 3

    x = torch.ones(4, 2)
    cases = [(Keeps(), nn.Sequential(Keeps(), PopsFoo()), "Keeps must stash 'foo'"),
             (Takes(), nn.Sequential(StashesFoo(), Takes()), "Takes must pop 'foo'")]
    for layer, model, message in cases:
        run = {"alone": layer, "plain": model, "gpipe": GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)}
        with pytest.raises(RuntimeError, match=message):
            run[where](x)
    # Doing what it declares, each works, alone and in a pipeline.
    model = nn.Sequential(StashesFoo(), PopsFoo())
    torch.testing.assert_close(GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)(x), x * 3)
    torch.testing.assert_close(StashesFoo()(x), x * 2)


@skippable(stash=["skip"])
class MaybeStash(nn.Module):
    def forward(self, x: Tensor) -> Any:
        if self.training:
            yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class PopSkip(nn.Module):
    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        return x + skip


@skippable(pop=["skip"])
class PopTwice(nn.Module):
    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        again = yield pop("skip")
        return x + skip + again


@skippable(stash=["skip"])
class StashInput(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("skip", x)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("balance", [[3], [1, 2], [1, 1, 1]])
def test_a_declared_stash_not_made_is_a_runtime_error_everywhere(balance: List[int]) -> None:
    # A skip that does not run as declared: across partitions the popping worker waited forever for a skip
    # that the eval-mode layer never stashed.
    model = nn.Sequential(MaybeStash(), nn.Identity(), PopSkip())
    piped = cpu_gpipe(model, balance, chunks=2)
    piped(torch.randn(4, 2))  # in training it is stashed
    # Now the layer itself says so, as in torchgpipe, in the pipeline and outside.
    piped.eval()
    with pytest.raises(RuntimeError, match="MaybeStash must stash 'skip'"):
        piped(torch.randn(4, 2))
    model.eval()
    with pytest.raises(RuntimeError, match="MaybeStash must stash 'skip'"):  # the plain module says the same
        model(torch.randn(4, 2))
    piped.train()
    piped(torch.randn(4, 2))  # and the next step works


@pytest.mark.timeout(60)
@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_a_skip_popped_twice_is_a_runtime_error(balance: List[int]) -> None:
    # A layer that pops a skip a second time, in one forward, is told so, whatever the balance.
    piped = cpu_gpipe(nn.Sequential(StashInput(), PopTwice()), balance, chunks=2)
    with pytest.raises(RuntimeError, match="PopTwice popped 'skip'"):
        piped(torch.randn(4, 2))


# --- skips in a plain nn.Sequential --------------------------------------------------------------------


class Boom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("boom")


@skippable(stash=["skip"])
class Recorded(nn.Module):
    """Stashes ``2 * x`` and remembers a weak reference to it."""

    def __init__(self, refs: List["weakref.ref[Tensor]"]) -> None:
        super().__init__()
        self.refs = refs

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = x * 2
        self.refs.append(weakref.ref(y))
        yield stash("skip", y)
        return x


def test_pop_after_a_forward_that_raised_does_not_get_its_stash() -> None:
    """Outside GPipe, stashes were kept per thread until popped: a forward that raised between its stash
    and its pop left the tensor behind, and the next forward that popped without stashing got it, a
    tensor of another batch, silently. A pop sees only the stashes of its own forward."""
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="boom"):
        nn.Sequential(Stash(4), Boom(), Pop(4))(x)
    with pytest.raises(RuntimeError, match=r"Pop popped 'skip' .*no layer stashed it earlier in this forward"):
        nn.Sequential(nn.Linear(4, 4), Pop(4))(x)

    # A stash left unpopped by a forward that returned is not seen either.
    nn.Sequential(Stash(4), nn.Linear(4, 4))(x)
    with pytest.raises(RuntimeError, match="no layer stashed it"):
        nn.Sequential(nn.Linear(4, 4), Pop(4))(x)


def test_leftover_stashes_are_freed_when_their_forward_ends() -> None:
    """The per-thread tracker held every stash no pop took, for ever: a forward that raised, or a
    model that stashes more than it pops, kept activations alive after the forward was over."""
    gc.disable()  # freed by reference counting, right away, not by a later collection
    try:
        refs: List[weakref.ref[Tensor]] = []
        x = torch.randn(2, 4)
        try:
            nn.Sequential(Recorded(refs), Boom(), Pop(4))(x)
        except ValueError:
            pass
        assert refs[-1]() is None, "the stash of a forward that raised outlived it"

        nn.Sequential(Recorded(refs), nn.Linear(4, 4))(x)
        assert refs[-1]() is None, "a stash never popped outlived its forward"

        with pytest.raises(ValueError) as info:
            nn.Sequential(Recorded(refs), Boom(), Pop(4))(x)
        assert refs[-1]() is not None  # the traceback keeps the forward's frames, as any local
        del info
        assert refs[-1]() is None
    finally:
        gc.enable()


def test_skips_still_work_by_hand_nested_and_in_data_parallel_replicas() -> None:
    """What the scoping of plain skips must keep working: layers called by hand (in a function and at a
    script's top level), a stash inside a nested Sequential popped by the outer one, and DataParallel
    replicas that run the model on worker threads."""
    x = torch.randn(4, 4)
    stash_layer, pop_layer = Stash(4), Pop(4)
    y = stash_layer.linear(x)
    expected = pop_layer.linear(y.tanh()) * y

    def by_hand() -> Tensor:
        return pop_layer(stash_layer(x))

    torch.testing.assert_close(by_hand(), expected)
    namespace = {"stash_layer": stash_layer, "pop_layer": pop_layer, "x": x}
    exec("out = pop_layer(stash_layer(x))", namespace)  # a script's top level
    torch.testing.assert_close(namespace["out"], expected)

    nested = nn.Sequential(nn.Sequential(stash_layer, nn.Identity()), pop_layer)
    torch.testing.assert_close(nested(x), expected)

    model = nn.Sequential(Stash(4), nn.Linear(4, 4), Pop(4))
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4)
    torch.testing.assert_close(DataParallel(model, ["cpu", "cpu", "cpu"])(x), plain(x))


# --- U-Net ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 1, 1, 1, 1, 1, 1], [2, 3, 2], [3, 1, 3], [7]])
def test_unet_is_transparent(checkpoint: str, balance: List[int]) -> None:
    assert_transparent(skippable_unet(), balance, chunks=3, checkpoint=checkpoint, batch=7)


# --- no leak -------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_nothing_stays_in_flight_after_backward(checkpoint: str) -> None:
    refs: List[weakref.ref] = []

    @skippable(stash=["skip"])
    class Recording(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            y = x * 2
            refs.append(weakref.ref(y))
            yield stash("skip", y)
            return x

    model = nn.Sequential(Recording(), nn.Linear(4, 4), nn.Linear(4, 4), Pop())
    piped = GPipe(model, [1, 2, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    for _ in range(5):
        piped(torch.randn(6, 4, requires_grad=True)).sum().backward()
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_no_grad_forward_leaves_nothing_in_flight() -> None:
    refs: List[weakref.ref] = []

    @skippable(stash=["skip"])
    class Recording(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            refs.append(weakref.ref(x))
            yield stash("skip", x)
            return x

    piped = GPipe(nn.Sequential(Recording(), nn.Linear(4, 4), Pop()), [1, 1, 1], devices=["cpu"] * 3, chunks=2)
    with torch.no_grad():
        piped(torch.randn(4, 4))
    gc.collect()
    assert refs and all(r() is None for r in refs)


# --- current_microbatch(), the seed's way --------------------------------------------------------


def seed_model(position: int) -> nn.Sequential:
    """The user guide's example: layer ``position`` remembers its input per micro-batch, the last adds it."""
    remember, recall = remember_and_recall()
    layers: List[nn.Module] = [nn.Linear(4, 4) for _ in range(6)]
    layers.insert(position, remember)
    layers.append(recall)
    return nn.Sequential(*layers)


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize("chunks", [1, 4])
def test_seed_current_microbatch_example_with_checkpoint_never(position: int, chunks: int) -> None:
    assert_transparent(seed_model(position), [2, 2, 2, 2], chunks=chunks, checkpoint="never", batch=8)


def test_current_microbatch_identity() -> None:
    seen: Dict[str, List[Optional[object]]] = {"first": [], "last": [], "recompute": []}

    class Look(nn.Module):
        def __init__(self, where: str) -> None:
            super().__init__()
            self.where = where

        def forward(self, x: Tensor) -> Tensor:
            where = "recompute" if torchpipe.is_recomputing() else self.where
            seen[where].append(torchpipe.current_microbatch())
            return x

    model = nn.Sequential(Look("first"), nn.Linear(2, 2), Look("last"))
    piped = GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="always")
    assert torchpipe.current_microbatch() is None
    out = piped(torch.randn(6, 2, requires_grad=True))
    keys = weakref.WeakKeyDictionary({k: True for k in seen["first"]})
    assert len(keys) == 3
    assert seen["first"] == seen["last"]
    hash(seen["first"][0])
    out.sum().backward()
    assert sorted(map(id, seen["recompute"])) == sorted(map(id, seen["first"] * 2))
    seen.clear()
    gc.collect()
    assert len(keys) == 0


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[1, 1, 1], [3]])
def test_stashing_none_pops_none(checkpoint: str, balance: List[int]) -> None:
    @skippable(stash=["maybe"])
    class StashNone(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("maybe", None)
            return x * 2

    @skippable(pop=["maybe"])
    class PopNone(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            maybe = yield pop("maybe")
            assert maybe is None
            return x + 1

    model = nn.Sequential(StashNone(), nn.Linear(4, 4), PopNone())
    assert_transparent(model, balance, chunks=2, checkpoint=checkpoint)
