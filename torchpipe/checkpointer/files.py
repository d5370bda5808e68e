"""A checkpointer's directory on disk: one directory per saved step, a mark that says it is complete, and writes
that reach the disk (see [Note: complete checkpoints] in ``checkpointer/__init__.py``)."""
import os
import re
import socket
from pathlib import Path
from typing import List, Optional, Tuple

__all__ = ["MARK", "STEP_DIRECTORY", "check_directory", "listing", "write", "sync_directory"]

#: The file that marks a checkpoint's directory complete (see [Note: complete checkpoints]).
MARK = "torchpipe-complete.json"
#: A saved step's directory: ``step-<n>``.
STEP_DIRECTORY = re.compile(r"^step-(\d+)$")


def check_directory(path: Path) -> Optional[Tuple[str, str]]:
    """Whether this process can keep checkpoints in ``path``: None, or the error's type name and message."""
    if path.exists() and not path.is_dir():
        return "ValueError", (f"the checkpoint directory {str(path)!r} is a file; pass a directory (it is made if "
                              "missing), or move the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return "OSError", (f"cannot make the checkpoint directory {str(path)!r} on host {socket.gethostname()}: "
                           f"{exc}; pass a directory this process can create")
    probe = path / f".torchpipe-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return "OSError", (f"cannot write in the checkpoint directory {str(path)!r} on host {socket.gethostname()}: "
                           f"{exc}; pass a directory this process can write")
    return None


def listing(directory: Path) -> List[Tuple[int, Path, bool]]:
    """The step directories under ``directory``: (step, path, whether complete), in no order."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = STEP_DIRECTORY.match(entry.name)
        if match and entry.is_dir():
            path = Path(entry.path)
            found.append((int(match.group(1)), path, (path / MARK).is_file()))
    return found


def write(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and flushes it to the disk."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def sync_directory(path: Path) -> None:
    """Flushes a rename in ``path`` to the disk (where the platform can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
