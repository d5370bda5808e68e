"""A rank that dies between steps, or in a collective through the store, ends the pipeline on every rank at once.

[Note: liveness] A rank that dies in a step is noticed by its peers, whose
receives fail (see [Note: control plane] in channel.py). Elsewhere nothing
told them: a rank waiting in the store for a step's start that a dead first
stage would never publish, or for a dead rank's part of a collective through
the store (``clip_grad_norm_``'s exchange), waited for the pipeline's timeout
(30 minutes), where the store outlives the dead rank (torchrun's agent hosts
it). Under torchrun on one host the agent stops the survivors anyway; across
hosts with a static rendezvous nobody does, and a restart waited for them.

So the ranks of a pipeline (of a whole mesh) hold a ring of plain TCP
connections, each to the next rank, made when the first pipeline over them
is: a daemon thread per process watches the two connections of each ring,
which carry nothing. When one closes, the rank at its other end has ended
(killed, crashed, or gone home), and every pipeline over those ranks is
broken for good: the watcher records a failure of each such pipeline's
current and next step, which wakes every rank waiting in the store for them
(the failure's marks), so every survivor raises ``PipelineError`` within a
second and can exit. A rank that ends normally, after the pipeline's last
step, closes its connections too: its peers record the failure of steps that
never come.

Plain sockets, not a gloo group: a receive left pending in a gloo group when
a process ends normally aborts it ("terminate called without an active
exception"). The address each rank listens on is that of its interface to the
store's host; where the default group's store is not a TCPStore, there is no
ring (the launcher must stop the survivors, or they wait for the timeout).
"""
import datetime
import selectors
import socket
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

__all__ = ["watch"]

_rings: Dict[Tuple[int, ...], "_Ring"] = {}
_lock = threading.Lock()


class _Ring:
    """This process's two connections of the ring over ``ranks``, and the channels that run over them."""

    def __init__(self, ranks: Tuple[int, ...], peers: List[Tuple[int, socket.socket]]) -> None:
        self.ranks = ranks
        self.channels: weakref.WeakSet[Any] = weakref.WeakSet()
        self.gone: Optional[int] = None
        self._selector = selectors.DefaultSelector()
        for peer, connection in peers:
            connection.setblocking(False)
            self._selector.register(connection, selectors.EVENT_READ, peer)
        self._thread = threading.Thread(target=self._watch, name="torchpipe-liveness", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            for key, _ in self._selector.select():
                connection: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = connection.recv(64)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:  # nothing is ever sent: ignore
                    continue
                self._selector.unregister(connection)
                connection.close()
                self._peer_gone(int(key.data))
            if not self._selector.get_map():
                return

    def _peer_gone(self, peer: int) -> None:
        self.gone = peer
        if not _store_reachable():
            # The store went with the peer (its host, rank 0 outside torchrun, ended first): nobody can read a
            # mark now (the waits say so themselves), and each try would fill this rank's log with the store
            # client's complaints as the job ends.
            return
        for channel in list(self.channels):
            who = f"rank {channel.global_ranks.index(peer)}" if peer in channel.global_ranks else f"global rank {peer}"
            sequence = channel.sequence
            message = (f"{who} died or ended (its connection to rank {channel.who} closed) while rank {channel.who} "
                       f"was at step {sequence}; the pipeline cannot go on without it: restart the job")
            for step in (sequence, sequence + 1):
                try:
                    channel.fail(step, message)
                except Exception:  # noqa: BLE001 - the store's host went too: the waits will say so
                    return


def watch(channel: Any, timeout: datetime.timedelta) -> None:
    """Adds ``channel`` to the ring of its ranks (made with the first channel over them: a collective of those
    ranks, through ``channel.store``), so that a rank that ends fails its pipelines everywhere. No-op for a
    single rank, or where the default store is not a TCPStore."""
    ranks = tuple(channel.mesh_ranks)
    if len(ranks) < 2:
        return
    with _lock:
        ring = _rings.get(ranks)
        if ring is None:
            ring = _make_ring(channel, ranks, timeout)
            if ring is None:
                return
            _rings[ranks] = ring
    ring.channels.add(channel)
    if ring.gone is not None:  # a rank of the ring had already ended: this pipeline is broken from the start
        ring._peer_gone(ring.gone)


def _default_tcp_store() -> Optional[TCPStore]:
    store: Any = dist.distributed_c10d._get_default_store()
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, TCPStore) else None


def _store_host() -> Optional[str]:
    store = _default_tcp_store()
    return None if store is None else str(store.host)


def _store_reachable() -> bool:
    """Whether the default store's server still takes a connection (a plain one, opened and closed at once: the
    store's own client would retry, and log every failure)."""
    try:
        store = _default_tcp_store()
        if store is None:
            return True
        with socket.create_connection((store.host, store.port), timeout=1.0):
            return True
    except (OSError, RuntimeError):  # refused, unreachable, or no default group any more
        return False


def _local_address(host: str) -> Tuple[int, str]:
    """The address family and this host's address on the interface that reaches ``host``."""
    family, kind, _, _, address = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)  # UDP: nothing is sent; the kernel picks the route and the local address
        return family, str(probe.getsockname()[0])


def _make_ring(channel: Any, ranks: Tuple[int, ...], timeout: datetime.timedelta) -> Optional[_Ring]:
    host = _store_host()
    index = channel.index
    store = PrefixStore("liveness/", channel.store)
    if host is None:
        return None
    try:
        family, address = _local_address(host)
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(4)
    except OSError:  # no route to the store's host from here (it is there: the group was made through it)
        return None
    seconds = timeout.total_seconds()
    with listener:
        store.set(f"{index}", f"{listener.getsockname()[1]} {address}")
        following = (index + 1) % len(ranks)
        port, where = bytes(store.get(f"{following}")).decode().split(" ", 1)
        to_next = socket.create_connection((where, int(port)), timeout=seconds)
        listener.settimeout(seconds)
        from_previous, _ = listener.accept()
    for connection in (to_next, from_previous):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a host that vanishes, in the end
    previous = (index - 1) % len(ranks)
    return _Ring(ranks, [(ranks[following], to_next), (ranks[previous], from_previous)])
