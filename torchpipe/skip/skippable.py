"""``@skippable``, ``stash`` and ``pop``: layers that hand tensors to distant layers.

A skippable layer's ``forward`` is a generator. ``yield stash('name', tensor)``
hands ``tensor`` to a later layer; ``tensor = yield pop('name')`` takes it.
Where the tensor goes is the business of the *tracker* of the running task:
inside GPipe the runner's tracker for this (micro-batch, partition) moves it
straight to the popping partition; outside GPipe a tracker keeps it with the
forward that stashed it until the pop (see ``torchpipe.skip.registry``), so
skippable layers also run in a plain ``nn.Sequential``.
"""
import sys
from collections import abc
from types import FrameType
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Optional,
    Set,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)

from torch import Tensor, nn

from torchpipe.context import current
from torchpipe.skip.namespace import DEFAULT, Namespace
from torchpipe.skip.registry import PlainTracker, Tracker

__all__ = ["skippable", "stash", "pop", "Skippable", "current_tracker"]

M = TypeVar("M", bound=nn.Module)


class stash:
    """``yield stash(name, tensor)`` in a skippable forward hands ``tensor`` to the layer that pops ``name``.

    ``tensor`` may be ``None`` (the pop then gets ``None``), as in torchgpipe.
    """

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"stash({name!r}, ...) takes a Tensor or None, got {type(tensor).__name__}")
        self.name = name
        self.tensor = tensor


class pop:
    """``tensor = yield pop(name)`` in a skippable forward takes the tensor stashed as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def current_tracker(caller: Optional[FrameType] = None) -> Tracker:
    """The tracker that serves stash and pop requests made now: the running pipeline task's, else a plain one.

    Outside a pipeline, a layer's skips belong to its forward's caller ([Note: plain skips]): ``caller`` is
    the frame that called the layer's ``forward`` (default: the caller of the function that asks, for a
    layer whose ``forward`` calls this directly).
    """
    skips: Optional[Tracker] = current().skips
    if skips is not None:
        return skips
    return PlainTracker(caller if caller is not None else sys._getframe(2))


class Skippable(nn.Module):
    """The base that :func:`skippable` adds to a decorated class (for ``isinstance`` checks)."""

    stashable_names: ClassVar[FrozenSet[str]] = frozenset()
    poppable_names: ClassVar[FrozenSet[str]] = frozenset()
    _skip_namespaces: Dict[str, Namespace]

    def isolate(self: "S", ns: Namespace, *, only: Optional[Iterable[str]] = None) -> "S":
        """Puts this layer's skip names (or only those in ``only``) in namespace ``ns``; returns the layer."""
        names = self.stashable_names | self.poppable_names
        chosen = set(names if only is None else only)
        unknown = chosen - names
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no skip names {sorted(unknown)} (it stashes "
                f"{sorted(self.stashable_names)} and pops {sorted(self.poppable_names)})"
            )
        namespaces = dict(self.__dict__.get("_skip_namespaces", {}))
        for name in chosen:
            namespaces[name] = ns
        self.__dict__["_skip_namespaces"] = namespaces
        return self

    def namespaced(self, name: str) -> Tuple[Namespace, str]:
        """The ``(namespace, name)`` key of one of this layer's skip names."""
        return self.__dict__.get("_skip_namespaces", {}).get(name, DEFAULT), name

    def stashed(self) -> List[Tuple[Namespace, str]]:
        return [self.namespaced(n) for n in sorted(self.stashable_names)]

    def popped(self) -> List[Tuple[Namespace, str]]:
        return [self.namespaced(n) for n in sorted(self.poppable_names)]

    def _drive(self, result: Any) -> Any:
        """Runs a generator forward, serving its stash and pop requests; returns its return value.

        Raises:
            RuntimeError: the forward stashed or popped a name it does not declare, or returned without
                stashing (popping) a name it declares, as torchgpipe's skippable layers do.
        """
        if not isinstance(result, abc.Generator):
            self._check_all_used(set(), set())
            return result
        # Outside a pipeline: sys._getframe(1) is forward(), whose caller may hold this forward's skips.
        tracker = current_tracker(sys._getframe(1).f_back)
        reply: Optional[Tensor] = None
        stashed: Set[str] = set()
        popped: Set[str] = set()
        try:
            while True:
                request = result.send(reply)
                reply = None
                if isinstance(request, stash):
                    if request.name not in self.stashable_names:
                        raise RuntimeError(
                            f"{type(self).__name__} stashed {request.name!r}, which it does not declare; "
                            f"add it to @skippable(stash=[...])"
                        )
                    tracker.save(self, *self.namespaced(request.name), request.tensor)
                    stashed.add(request.name)
                elif isinstance(request, pop):
                    if request.name not in self.poppable_names:
                        raise RuntimeError(
                            f"{type(self).__name__} popped {request.name!r}, which it does not declare; "
                            f"add it to @skippable(pop=[...])"
                        )
                    reply = tracker.load(self, *self.namespaced(request.name))
                    popped.add(request.name)
                else:
                    raise TypeError(
                        f"{type(self).__name__}.forward yielded {type(request).__name__}; a skippable "
                        "forward yields only stash(name, tensor) or pop(name)"
                    )
        except StopIteration as stop:
            self._check_all_used(stashed, popped)
            return stop.value

    def _check_all_used(self, stashed: Set[str], popped: Set[str]) -> None:
        """Every declared skip must be stashed (popped) by each forward, as in torchgpipe: a layer that skips
        one sometimes would leave the layer at the other end without it, or with a stale one."""
        problems = [
            f"stash {name!r} ({self.namespaced(name)[0]})" for name in sorted(self.stashable_names - stashed)
        ] + [f"pop {name!r} ({self.namespaced(name)[0]})" for name in sorted(self.poppable_names - popped)]
        if problems:
            raise RuntimeError(
                f"{type(self).__name__} must {' and '.join(problems)} in every forward, as its @skippable "
                "declares, but this forward returned without doing so; stash (or pop) it every time (stash None "
                "when there is nothing to hand over), or declare it on a layer that always does"
            )


S = TypeVar("S", bound=Skippable)


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[Type[M]], Type[M]]:
    """Class decorator: the layer's generator ``forward`` may stash and pop the given skip names.

    Example::

        @skippable(stash=['skip'])
        class Encoder(nn.Module):
            def forward(self, x):
                yield stash('skip', x)
                return self.conv(x)

        @skippable(pop=['skip'])
        class Decoder(nn.Module):
            def forward(self, x):
                skip = yield pop('skip')
                return self.conv(x) + skip
    """
    stashable = frozenset(_names(stash, "stash"))
    poppable = frozenset(_names(pop, "pop"))

    def decorate(cls: Type[M]) -> Type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module classes, got {cls!r}")
        original_forward = cls.forward

        def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
            return self._drive(original_forward(self, *args, **kwargs))

        def __repr__(self: nn.Module) -> str:
            # As torchgpipe prints a skippable layer: @skippable(Layer(...)).
            return f"@skippable({super(decorated, self).__repr__()})"

        namespace: Dict[str, Any] = {
            "forward": forward,
            "__repr__": __repr__,
            "stashable_names": stashable,
            "poppable_names": poppable,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        decorated: Type[Any] = type(cls.__name__, (cls, Skippable), namespace)
        return cast(Type[M], decorated)

    return decorate


def _names(names: Union[str, Iterable[str]], what: str) -> List[str]:
    if isinstance(names, str):
        raise TypeError(f"@skippable({what}=...) takes a list of names, got the string {names!r}; write [{names!r}]")
    listed = list(names)
    if not all(isinstance(n, str) for n in listed):
        raise TypeError(f"@skippable({what}=...) takes names as strings, got {listed!r}")
    return listed
