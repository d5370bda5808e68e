"""State dicts with the plain module's keys: a checkpoint moves between balances, world sizes and the plain module.

A pipeline keeps each layer of the ``nn.Sequential`` under a stage
(``GPipe``: ``partitions.1.3.weight`` for layer ``3`` in partition 1). The
plain module's key drops the stage prefix (``3.weight``). Since layers keep
their names in every stage, a key of any balance maps to the plain key, and
the plain key to this pipeline's own.
"""
import re
from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping

__all__ = ["PlainKeys"]

_PREFIX = re.compile(r"^partitions\.\d+\.")


class PlainKeys:
    """Translates state-dict keys between the plain module's and a pipeline's own.

    Args:
        prefixes: for each layer name this pipeline holds, the prefix of its
            own keys (``{'3': 'partitions.1.'}``).
    """

    def __init__(self, prefixes: Mapping[str, str]) -> None:
        self.prefixes = dict(prefixes)

    @staticmethod
    def plain(key: str) -> str:
        """The plain module's key for a key of any GPipe (or a plain key, returned as it is)."""
        return _PREFIX.sub("", key, count=1)

    def to_plain(self, state_dict: Mapping[str, Any]) -> Dict[str, Any]:
        """``state_dict`` with the plain module's keys (and its version metadata translated too)."""
        return _translated(state_dict, self.plain)

    def own(self, key: str) -> str:
        """This pipeline's key for a plain or any GPipe's key (unknown layers keep their key)."""
        plain = self.plain(key)
        prefix = self.prefixes.get(plain.split(".", 1)[0])
        return key if prefix is None else prefix + plain

    def to_own(self, state_dict: Mapping[str, Any]) -> Dict[str, Any]:
        """``state_dict`` with this pipeline's keys, whatever balance (or plain module) it came from."""
        return _translated(state_dict, self.own)


def _translated(state_dict: Mapping[str, Any], key: Callable[[str], str]) -> Dict[str, Any]:
    result: Dict[str, Any] = OrderedDict((key(k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # Per-module versions (BatchNorm's, say), keyed by module prefix ('' for the root).
        result._metadata = OrderedDict((key(k) if k else k, v) for k, v in metadata.items())  # type: ignore[attr-defined]
    return result
