"""Namespaces for skip names, so the same skippable class can appear several times in one model."""
import uuid
from typing import Any

__all__ = ["Namespace", "DEFAULT"]


class Namespace:
    """A fresh namespace: skip names isolated in different namespaces never meet.

    A namespace is a value, as in torchgpipe: its copies (``copy.copy``,
    ``copy.deepcopy``, a pickle round trip, in this process or another) are
    equal to it and hash alike, so a deep-copied model still pairs its stashes
    with its pops. Two namespaces made by two calls of ``Namespace()`` are
    never equal and never print alike.

    Example::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Stash().isolate(ns1), Pop().isolate(ns1),
                              Stash().isolate(ns2), Pop().isolate(ns2))
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        #: What makes this namespace itself: a random (version 4) UUID, unique across processes.
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return "<Namespace default>" if self.id == _DEFAULT_ID else f"<Namespace '{self.id}'>"

    # Through the UUID's int: UUID's own methods are Python code, and skips are looked up per layer call.
    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id.int == other.id.int
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.id.int)

    def __lt__(self, other: "Namespace") -> bool:
        # Skip layouts sort (namespace, name) keys; any fixed order will do.
        if isinstance(other, Namespace):
            return self.id.int < other.id.int
        return NotImplemented


#: The nil UUID: the default namespace is the same value in every process.
_DEFAULT_ID = uuid.UUID(int=0)

#: The namespace of every skip name that was not isolated.
DEFAULT = Namespace()
DEFAULT.id = _DEFAULT_ID
