"""Regressions of skips, balancing, the data-parallel wrappers and Python 3.9: one test per bug, named after it,
with the story of what went wrong (the runtime's are in test_bugs.py)."""
import copy
import gc
import pickle
import weakref
from typing import List

import pytest
import torch
from torch import Tensor, nn

from tests import models
from tests.models import Pop, Stash
from torchpipe import GPipe
from torchpipe.parallel import DataParallel
from torchpipe.parallel.collate import per_output
from torchpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from torchpipe.skip.namespace import DEFAULT
from torchpipe_balancing import balance_by_size, balance_by_time

# --- torchgpipe 0.0.7 compatibility of torchpipe.skip (issue item 17) ---------------------------------


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


# --- Python 3.9 (issue item 21) --------------------------------------------------------------------------


def test_per_output_tuples_of_different_lengths_on_python_3_9() -> None:
    """``zip(..., strict=True)`` in parallel/collate.py is Python 3.10; on 3.9, the declared minimum, every
    TupleParallel whose module returns a tuple raised TypeError. The length check is now explicit."""
    assert per_output([(1, "a"), (2, "b")]) == [(1, 2), ("a", "b")]
    with pytest.raises(ValueError, match="different lengths"):
        per_output([(1, 2), (3,)])
    items: List[int] = [1, 2]
    assert per_output(items) == (1, 2)


# --- skips in a plain nn.Sequential (issue item 14) ---------------------------------------------------


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



# --- balancing skippable models (issue item 15) ----------------------------------------------------------


def skippable_unet(depth: int = 3) -> nn.Sequential:
    """Each encoder stashes its output, a tensor with grad history; its decoder pops it."""
    return models.skippable_unet(depth, width=8, stash_output=True)


def test_balance_by_time_on_a_skippable_unet() -> None:
    """balance_by_time ran each layer's backward right after its forward; an encoder's backward freed the
    graph of the tensor it stashed, and its decoder's backward then failed with "Trying to backward
    through the graph a second time". The profiler now treats stashed tensors as the pipeline does:
    they end the stashing layer's backward, and the popping layer gets a leaf."""
    model = skippable_unet()
    before = copy.deepcopy(model.state_dict())
    balance = balance_by_time(3, model, torch.randn(16, 8), timeout=0.1, device="cpu")
    assert len(balance) == 3 and sum(balance) == len(model) and min(balance) >= 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    piped = GPipe(model, balance, devices=["cpu"] * 3, chunks=2)
    piped(torch.randn(4, 8)).sum().backward()


def test_balance_by_size_on_a_skippable_unet_counts_the_stash() -> None:
    """balance_by_size measured each layer in a function of its own, with no one serving stash and pop in
    between; the stash a layer holds until its pop is part of its memory, and is counted."""
    from torchpipe_balancing.profile import profile_sizes

    model = skippable_unet(depth=1)
    x = torch.randn(16, 8)
    sizes = profile_sizes(model, x, chunks=1, device=torch.device("cpu"))
    # The encoder keeps its output for relu's backward; the stash is that same storage, counted once.
    assert sizes[0].activation_bytes == 16 * 8 * 4 + 16 * 8 * 4  # the input of linear, relu's output
    balance = balance_by_size(2, skippable_unet(), x, chunks=2, device="cpu")
    assert sum(balance) == 7

    @skippable(stash=["skip"])
    class StashOnly(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x * 3)  # saved by nothing: held only by the skip
            return x

    @skippable(pop=["skip"])
    class PopOnly(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("skip")
            return x + skip

    sizes = profile_sizes(nn.Sequential(StashOnly(), PopOnly()), x, chunks=1, device=torch.device("cpu"))
    assert sizes[0].activation_bytes == 16 * 8 * 4


# --- DataParallel's non-tensor outputs (issue item 13) ---------------------------------------------------


class Counting(nn.Module):
    """Returns its rows' logits and how many rows it saw, in several shapes of output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        logits = self.linear(x)
        rows = x.shape[0]
        return {
            "pair": (logits, rows),
            "nested": {"rows": rows, "names": [f"row{rows}"], "none": None, "kept": logits * 2},
        }


def test_data_parallel_keeps_every_replicas_non_tensor_outputs() -> None:
    """DataParallel's gather took non-tensor leaves from replica 0 alone: a module returning
    ``(logits, count)`` gave replica 0's count for the whole batch and dropped the others. Each such
    leaf is now a tuple with one value per replica (also inside dicts; None everywhere stays None)."""
    model = Counting()
    x = torch.randn(5, 3)  # 3 rows and 2 rows on two replicas
    out = DataParallel(model, ["cpu", "cpu"])(x)
    logits, rows = out["pair"]
    torch.testing.assert_close(logits, model.linear(x))
    assert rows == (3, 2)
    assert out["nested"]["rows"] == (3, 2)
    assert out["nested"]["names"] == [("row3", "row2")]
    assert out["nested"]["none"] is None
    torch.testing.assert_close(out["nested"]["kept"], model.linear(x) * 2)

    # One replica: the same rule, so code does not change with the number of devices.
    assert DataParallel(model, ["cpu"])(x)["pair"][1] == (5,)

    # except_keywords: the kept values are per-replica tuples as before; the rest follows the rule.
    kept = DataParallel(model, ["cpu", "cpu"], except_keywords=["kept"])(x)
    assert isinstance(kept["nested"]["kept"], tuple) and [t.shape[0] for t in kept["nested"]["kept"]] == [3, 2]
    assert kept["pair"][1] == (3, 2) and kept["nested"]["rows"] == (3, 2)

    # gather_to_one_device=False gives each replica's output whole; sort_and_gather gathers by the rule.
    apart = DataParallel(model, ["cpu", "cpu"], gather_to_one_device=False)(x)
    assert [o["pair"][1] for o in apart] == [3, 2] and [o["nested"]["names"] for o in apart] == [["row3"], ["row2"]]
    sorted_out = DataParallel(model, ["cpu", "cpu"], gather_to_one_device=False, sort_and_gather=True)(x)
    assert sorted_out["pair"][1] == (3, 2)
    listed = DataParallel(model, ["cpu", "cpu"], batch_outputs=False)(x)
    assert [o["pair"][1] for o in listed] == [3, 2]
