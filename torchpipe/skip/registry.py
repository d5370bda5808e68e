"""Where skip tensors wait between their stash and their pop.

A :class:`Tracker` serves the stash and pop requests of skippable layers.
Outside GPipe, a :class:`PlainTracker` keeps them with the forward that made
them (see [Note: plain skips]). Inside a pipeline each (stage, micro-batch)
task runs with a tracker of its own (``StageSkips``, in
:mod:`torchpipe.skip.tracker`) that keeps them in the step's
:class:`SkipRegistry`, keyed by micro-batch, namespace and name, and sends
them between stages.

[Note: plain skips] In a plain forward (no GPipe) a pop must see the stashes
of its own forward and nothing else: not one left behind by an earlier
forward that raised between the stash and the pop, nor one that an earlier
forward never popped; and such leftovers must not stay in memory. So the skip
tensors live *in the frame of the forward*, as a local variable would:

* the forward is the call of the outermost module on the thread's stack (the
  model's ``__call__``, found by the code object of ``nn.Module._call_impl``),
  or, for skippable layers called by hand outside any module, the function
  that calls them;
* its skip tensors go in a small :class:`_Scope` stored among that frame's
  local variables (``frame.f_locals``, under a name no code uses), so they are
  freed with the frame: when the forward returns, or, when it raised, with
  the exception's traceback, like the forward's other locals;
* a pop looks in the scope of its own forward only, so a stash of another
  forward is never found: the pop raises ``RuntimeError`` naming the layer and
  the skip.

Frames belong to one thread, so replicas running on worker threads
(``torchpipe.parallel``) each have their own forward. Code that is not in a
function (a script's top level, ``exec``) keeps its skip tensors in a
per-thread scope instead, where they stay until they are popped, as that
code's variables do. The cost is a walk up the stack: the first stash of a
forward walks the whole stack; each thread remembers the scope of the
last module call it stored skips in, so the later stashes and pops of that
forward stop at its frame (a scope that is alive
keeps its frame alive, so the frame's ``id`` is not reused). On Python 3.12
and before, reading ``f_locals`` also takes a snapshot of the frame's
variables, which a function calling layers by hand keeps until its next
stash or pop; a module call's frame holds only its arguments.
"""
import threading
import weakref
from types import CodeType, FrameType
from typing import Any, Dict, FrozenSet, Optional, Protocol, Tuple

from torch import Tensor, nn

from torchpipe.skip.namespace import Namespace

__all__ = ["Tracker", "PlainTracker", "SkipRegistry", "SkipKey"]

#: (micro-batch index, namespace, name)
SkipKey = Tuple[int, Namespace, str]


class Tracker(Protocol):
    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None: ...

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]: ...


def _module_call_codes() -> Tuple[CodeType, FrozenSet[CodeType]]:
    """The code of ``nn.Module._call_impl``, and every code object of the machinery of a module call."""
    call = nn.Module._call_impl.__code__
    machinery = {call}
    machinery.update(c for c in call.co_consts if isinstance(c, CodeType))  # _call_impl's inner()
    wrapped = getattr(nn.Module, "_wrapped_call_impl", None)
    if wrapped is not None:
        machinery.add(wrapped.__code__)
    return call, frozenset(machinery)


_MODULE_CALL, _CALL_MACHINERY = _module_call_codes()
#: The local variable of a forward's frame that holds its skip tensors.
_SCOPE_VARIABLE = "__torchpipe_skip_tensors__"
_CO_OPTIMIZED = 0x1  # inspect.CO_OPTIMIZED: a function's frame, whose f_locals is its own


class _Scope:
    """The skip tensors of one plain forward that are stashed and not popped yet."""

    __slots__ = ("tensors", "__weakref__")

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}


class _ThreadScopes(threading.local):
    #: The skips of code that is not in a function (a script's top level).
    top_level: Optional[_Scope] = None
    #: The scope of the module call this thread stored skips in last, and the id of that call's frame.
    last: "Optional[weakref.ref[_Scope]]" = None
    last_frame: int = 0


_scopes = _ThreadScopes()


def _find_scope(layer: Any, frame: Optional[FrameType], create: bool) -> Optional[_Scope]:
    """The skips of the forward that runs ``layer``, called from ``frame`` (see [Note: plain skips])."""
    last = _scopes.last() if _scopes.last is not None else None
    outermost: Optional[FrameType] = None
    walk = frame
    while walk is not None:
        if last is not None and id(walk) == _scopes.last_frame:
            return last  # the outermost module call on the stack, found before
        if walk.f_code is _MODULE_CALL:
            outermost = walk
        walk = walk.f_back
    module_call = False
    variables: Any = None
    if outermost is not None:
        variables = outermost.f_locals
        module_call = variables.get("self") is not layer
    if not module_call:
        # Called by hand, outside any module: the forward is the code that called the layer.
        caller = outermost.f_back if outermost is not None else frame
        while caller is not None and caller.f_code in _CALL_MACHINERY:
            caller = caller.f_back
        if caller is None or not caller.f_code.co_flags & _CO_OPTIMIZED:
            if _scopes.top_level is None and create:
                _scopes.top_level = _Scope()
            return _scopes.top_level
        variables = caller.f_locals
    scope: Optional[_Scope] = variables.get(_SCOPE_VARIABLE)
    if scope is None and create:
        scope = _Scope()
        variables[_SCOPE_VARIABLE] = scope
    if scope is not None and module_call:
        _scopes.last, _scopes.last_frame = weakref.ref(scope), id(outermost)
    return scope


class PlainTracker:
    """Skip tensors of a plain (not pipelined) forward, kept in the forward's frame ([Note: plain skips]).

    Made for one call of one skippable layer; ``caller`` is the frame that
    called the layer's ``forward``.
    """

    __slots__ = ("caller", "_scope")

    def __init__(self, caller: Optional[FrameType]) -> None:
        self.caller = caller
        self._scope: Optional[_Scope] = None

    def _find(self, layer: Any, create: bool) -> Optional[_Scope]:
        if self._scope is None:
            self._scope = _find_scope(layer, self.caller, create)
        return self._scope

    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        scope = self._find(layer, create=True)
        assert scope is not None
        scope.tensors[(ns, name)] = tensor

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        scope = self._find(layer, create=False)
        if scope is None or (ns, name) not in scope.tensors:
            raise RuntimeError(
                f"{type(layer).__name__} popped {name!r} ({ns}) but no layer stashed it earlier in this "
                "forward; a pop sees only the stashes of its own forward (the same call of the outermost "
                "module, or of the function that calls the layers by hand), never those of an earlier one"
            )
        return scope.tensors.pop((ns, name))


class SkipRegistry:
    """The skip tensors of one pipelined step that are in flight, keyed by micro-batch, namespace and name.

    ``stashed`` holds the stashing side (with its graph, for the stashing
    partition's backward), ``popped`` the leaves the popping partition received
    (whose ``.grad`` goes back to the stashing side), ``local`` the skips whose
    stash and pop are in the same partition. Entries leave as soon as they are
    used; after a micro-batch's backward nothing of it remains.
    """

    def __init__(self) -> None:
        self.stashed: Dict[SkipKey, Optional[Tensor]] = {}
        self.popped: Dict[SkipKey, Optional[Tensor]] = {}
        self.local: Dict[SkipKey, Optional[Tensor]] = {}

    def __len__(self) -> int:
        return len(self.stashed) + len(self.popped) + len(self.local)
