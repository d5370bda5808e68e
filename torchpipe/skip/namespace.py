"""Namespaces for skip names, so the same skippable class can appear several times in one model."""
import itertools
import threading

__all__ = ["Namespace", "DEFAULT"]

_counter = itertools.count()
_counter_lock = threading.Lock()


class Namespace:
    """A fresh namespace: skip names isolated in different namespaces never meet.

    Example::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Stash().isolate(ns1), Pop().isolate(ns1),
                              Stash().isolate(ns2), Pop().isolate(ns2))
    """

    __slots__ = ("_id",)

    def __init__(self) -> None:
        with _counter_lock:
            self._id = next(_counter)

    def __repr__(self) -> str:
        return "Namespace(default)" if self is DEFAULT else f"Namespace({self._id})"

    def __lt__(self, other: "Namespace") -> bool:
        return self._id < other._id


#: The namespace of every skip name that was not isolated.
DEFAULT = Namespace()
