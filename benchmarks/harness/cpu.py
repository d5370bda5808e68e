"""The CPU time and context switches of this process's threads, per kind of thread (from Linux's ``/proc``)."""
import os
from typing import Dict, Tuple

__all__ = ["THREAD_KINDS", "thread_cpu"]

#: The kinds of thread :func:`thread_cpu` tells apart, by the name the OS knows them by (threads Python starts
#: are all named after the interpreter: "other threads").
THREAD_KINDS = ("main", "gloo", "store", "other threads")


def thread_cpu() -> Dict[str, Tuple[float, int]]:
    """This process's CPU seconds and context switches so far, per kind of thread (:data:`THREAD_KINDS`: the
    main thread, gloo's, the ``torch.distributed`` store's server, the rest), from ``/proc/self/task`` (Linux;
    ``{}`` elsewhere). Threads that ended meanwhile are not counted; the CPU time is in clock ticks (10 ms)."""
    totals: Dict[str, Tuple[float, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        if int(tid) == os.getpid():
            kind = "main"
        elif "gloo" in name:  # gloo_tcp_loop, pt_gloo_runloop
            kind = "gloo"
        elif name.startswith("pt_tcpstore"):
            kind = "store"
        else:
            kind = "other threads"
        cpu, count = totals.get(kind, (0.0, 0))
        totals[kind] = (cpu + seconds, count + switches)
    return totals
