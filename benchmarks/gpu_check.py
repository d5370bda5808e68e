"""The GPU check: torchpipe's CUDA tests and measurements on one GPU, in one command and one report.

Written for a GPU machine where nothing can be installed (one H100 or H200,
16 cores, no package registry): it needs torch and pytest, and transformers for
section 4 (which says so and is skipped where it is missing). Within
``--budget`` seconds (8 minutes by default) it writes ``report.md`` and
``report.json`` to ``--out``, headed by the GPU, torch, CUDA, Python and the
git commit:

1. ``tests``: ``pytest -m cuda`` over the suite (tests/test_cuda.py, the CUDA
   cases of tests/test_transparency.py, the other CUDA-marked tests), with
   ``TORCHPIPE_SECOND_GPU=cuda:0`` on a machine of one GPU so that the tests of
   two GPUs run on one: each test's outcome.
2. ``gpipe``: GPipe on the GPU, an MLP and a small transformer, in float32 and
   in bf16 autocast: the step time over the plain module's and over the same 8
   micro-batches run by hand, for 1 partition x 1 and x 8 micro-batches and 2
   partitions (both on ``cuda:0``) x 8, in each checkpoint mode; the step's
   peak memory (``torch.cuda.max_memory_allocated``) over the plain module's.
3. ``schedules``: ``Pipeline`` with every built-in schedule
   (``torchpipe.schedule.NAMES``), two workers on ``cuda:0``: step time, peak
   memory, and the loss and gradients against the plain module's; then one
   ``zbv`` stage's split backward against its one backward
   (``experiments/split_backward.py``).
4. ``language_models``: ``as_sequential`` on GPT-2 and Llama (transformers
   configs, nothing downloaded) in bf16 on the GPU: a two-stage Pipeline's loss
   and gradients against the plain model's, within bf16 tolerances, and the
   tokens/s of both.
5. ``distributed``: benchmarks/distributed.py's measurements (torchpipe and
   ``torch.distributed.pipelining``, 2 gloo ranks on the CPU, the GPU hidden)
   on cores a 2-core machine does not have.

Each section runs in a child process of its own with its share of the
budget: an exception, a broken CUDA context or a hang in one is recorded in
the report (with the end of its traceback or log) and the next one runs.
Within a section each measurement is its own unit, so one failing unit loses
only its own figures. The report is rewritten after every section (and every
section's child saves what it measured as it goes), so a run cut short still
leaves one.

The sections' measurements are in benchmarks/gpu_sections.py, the markdown
in benchmarks/gpu_report.py; this file runs them and writes the report.

``--dry-run`` runs the same sections on the CPU with tiny sizes and a couple
of tests in place of the CUDA suite, in about a minute: tests/test_gpu_check.py
runs it, so that the check works the day a GPU is lent.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--out out/gpu-check] [--budget 480] [--sections gpipe ...]
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import gpu_sections  # noqa: E402
from benchmarks.gpu_report import markdown  # noqa: E402
from benchmarks.gpu_sections import DRY, GPU, Child, tail, write_atomically  # noqa: E402
from benchmarks.harness import ROOT  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.processes import child_environment  # noqa: E402

#: The whole check's time on the GPU machine, and the dry run's (its sections end long before: a hang's limit).
BUDGET_S = 480.0
DRY_BUDGET_S = 240.0
#: Seconds kept at the end of the budget to write the last report.
RESERVE_S = 5.0
#: Seconds a section's child has between its own deadline (it starts no new unit after it) and being stopped.
GRACE_S = 5.0


# --- the sections --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """A section of the report: its title, its share of the budget, and what its child process runs."""

    name: str
    title: str
    share: float
    run: Callable[[Child], None]


SECTIONS: Dict[str, Section] = {s.name: s for s in [
    Section("tests", "1. CUDA tests", 0.29, gpu_sections.run_tests),
    Section("gpipe", "2. GPipe on the GPU", 0.15, gpu_sections.run_gpipe),
    Section("schedules", "3. Pipeline: every schedule, two workers on one GPU", 0.10, gpu_sections.run_schedules),
    Section("language_models", "4. as_sequential on GPT-2 and Llama in bf16", 0.21,
            gpu_sections.run_language_models),
    Section("distributed", "5. Multi-process CPU benchmark (benchmarks/distributed.py)", 0.19,
            gpu_sections.run_distributed),
]}


def child_main(args: argparse.Namespace) -> int:
    """A section in its child process: 0 when it ran to its end (its units' errors are in its results)."""

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)  # so that `finally` blocks run: benchmarks/distributed.py stops its ranks
    sizes = DRY if args.dry_run else GPU
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    child = Child(Path(args.result), sizes, device, args.deadline)
    child.save()
    torch.manual_seed(0)
    try:
        SECTIONS[args.section].run(child)
    except KeyboardInterrupt:
        child.notes.append("stopped: the section's time was spent")
        child.save()
        return 3
    child.save()
    return 0


# --- the parent: budget, children, report --------------------------------------------------------------------


@dataclass
class Outcome:
    """How a section's child ended and what it left."""

    status: str  # "ok", "failed", "timed out", "skipped"
    seconds: float
    results: Dict[str, Any] = field(default_factory=dict)
    errors: List[Dict[str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    log: str = ""


def run_child(command: Sequence[str], result: Path, allowed: float, env: Mapping[str, str]) -> Outcome:
    """Runs a section's child for at most ``allowed`` seconds (then SIGTERM, and SIGKILL after ``GRACE_S``), and
    reads what it saved in ``result``.

    The status is ``ok`` when it exited with 0 having recorded no error, ``timed out`` when it had to be stopped,
    ``skipped`` when it said so, else ``failed``; the end of its output comes back as ``log``.
    """
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        child = subprocess.Popen(list(command), cwd=ROOT, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        timed_out = False
        try:
            code = child.wait(timeout=max(1.0, allowed))
        except subprocess.TimeoutExpired:
            timed_out = True
            code = stop_group(child)
        seconds = time.monotonic() - start
        log.seek(0)
        output = tail(log.read(), 40)
    saved: Dict[str, Any] = {}
    notes: List[str] = []
    try:
        saved = json.loads(result.read_text(encoding="utf-8"))
    except FileNotFoundError:
        notes.append("the section's process saved nothing")
    except (OSError, ValueError) as error:
        notes.append(f"the section's saved results could not be read: {error}")
    errors = list(saved.get("errors", []))
    notes = list(saved.get("notes", [])) + notes
    if timed_out:
        status = "timed out"
        notes.append(f"stopped after {seconds:.0f} s (its share of the budget: {allowed:.0f} s)")
    elif code != 0:
        status = "failed"
        errors.append({"unit": "process", "error": f"exited with {code}; the end of its output:\n{tail(output, 15)}"})
    elif saved.get("skipped"):
        status = "skipped"
        notes.append(f"skipped: {saved['skipped']}")
    else:
        status = "failed" if errors else "ok"
    return Outcome(status, seconds, saved.get("results", {}), errors, notes, output)


def stop_group(child: "subprocess.Popen[Any]") -> int:
    """SIGTERM to the child's process group, SIGKILL after ``GRACE_S``; its exit status."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return -9


def allowance(share: float, budget: float, saved: float, left: float) -> float:
    """A section's seconds: its share of the budget plus what earlier sections left unused, within what is left."""
    return max(0.0, min(share * budget + saved, left))


def git_commit() -> Optional[str]:
    """``HEAD``'s hash, marked when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if changed.stdout.strip() else "")


def source_fingerprint() -> str:
    """A hash of the Python sources (torchpipe, torchpipe_balancing, benchmarks, tests): it names the tree a report
    was made from where no git checkout came along (``--fingerprint`` prints it)."""
    digest = hashlib.sha256()
    for folder in ("torchpipe", "torchpipe_balancing", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def header(args: argparse.Namespace) -> Dict[str, Any]:
    cuda = torch.cuda.is_available()
    if args.dry_run:
        device = "cpu (dry run)"
    elif cuda:
        device = f"{torch.cuda.get_device_name(0)} (cuda:0 of {torch.cuda.device_count()})"
    else:
        device = "no CUDA device"
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run, "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None, "python": platform.python_version(),
        # 'highest': float32 products in float32 (PyTorch's default); 'high': in TF32.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "transformers": package_version("transformers"), "pytest": package_version("pytest"),
        "commit": git_commit(), "source_fingerprint": source_fingerprint(),
        "machine": machine_description(), "budget_s": args.budget,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }


def section_entry(section: Section, status: str = "pending") -> Dict[str, Any]:
    return {"title": section.title, "status": status, "seconds": None, "budget_s": None, "results": {},
            "errors": [], "notes": [], "log": ""}


def write_report(out: Path, report: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "report.json", json.dumps(report, indent=1, default=str) + "\n")
    write_atomically(out / "report.md", markdown(report))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu-check"), help="the report's folder")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole check (default {BUDGET_S:.0f}; dry run {DRY_BUDGET_S:.0f})")
    parser.add_argument("--dry-run", action="store_true", help="the same sections on the CPU with tiny sizes")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="run only these sections")
    parser.add_argument("--fingerprint", action="store_true", help="print the sources' fingerprint and exit")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section is not None:
        return child_main(args)
    if args.fingerprint:
        print(source_fingerprint())
        return 0
    args.budget = args.budget if args.budget is not None else (DRY_BUDGET_S if args.dry_run else BUDGET_S)
    start = time.monotonic()
    deadline = start + args.budget
    out = Path(args.out)
    chosen = [SECTIONS[name] for name in SECTIONS if name in args.sections]
    report: Dict[str, Any] = {"header": header(args), "sections": {s.name: section_entry(s) for s in chosen},
                              "finished": False, "wall_s": None}
    write_report(out, report)
    print(f"GPU check{' (dry run)' if args.dry_run else ''}: {report['header']['device']}, torch "
          f"{torch.__version__}; budget {args.budget:.0f} s; report in {out}", flush=True)
    no_cuda = not args.dry_run and not torch.cuda.is_available()
    saved = 0.0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        for number, section in enumerate(chosen, 1):
            entry = report["sections"][section.name]
            allowed = allowance(section.share, args.budget, saved, deadline - time.monotonic() - RESERVE_S)
            if no_cuda:
                entry.update(status="skipped", notes=[f"torch {torch.__version__} sees no CUDA device here; "
                                                      "--dry-run checks the script on the CPU"])
            elif allowed < 2 * GRACE_S:
                entry.update(status="skipped", notes=[f"the budget ({args.budget:.0f} s) was spent before it"])
            else:
                outcome = run_section(section, args, Path(folder), allowed)
                saved = max(0.0, allowed - outcome.seconds)
                entry.update(status=outcome.status, seconds=outcome.seconds, budget_s=allowed,
                             results=outcome.results, errors=outcome.errors, notes=outcome.notes,
                             log=outcome.log if outcome.status in ("failed", "timed out") else "")
            print(f"[{number}/{len(chosen)}] {section.name}: {entry['status']}"
                  + (f" in {entry['seconds']:.0f} s" if entry["seconds"] is not None else "")
                  + summary(section.name, entry), flush=True)
            report["wall_s"] = time.monotonic() - start
            write_report(out, report)
    report["finished"] = True
    report["wall_s"] = time.monotonic() - start
    write_report(out, report)
    print(f"report: {out / 'report.md'} and report.json, {report['wall_s']:.0f} s", flush=True)
    return 0 if all(entry["status"] == "ok" for entry in report["sections"].values()) else 1


def run_section(section: Section, args: argparse.Namespace, folder: Path, allowed: float) -> Outcome:
    result = folder / f"{section.name}.json"
    env = child_environment(PYTHONUNBUFFERED="1")
    if section.name == "distributed":
        env["CUDA_VISIBLE_DEVICES"] = ""  # its Pipeline would otherwise take cuda:LOCAL_RANK: this is the CPU's
    elif section.name == "tests" and not args.dry_run and torch.cuda.device_count() < 2:
        env["TORCHPIPE_SECOND_GPU"] = "cuda:0"  # the tests of two GPUs, on the one there is (tests/test_cuda.py)
    if args.dry_run:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the CPU's memory figure: freed tensors go back to the system
    command = [sys.executable, str(Path(__file__).resolve()), "--section", section.name, "--result", str(result),
               "--deadline", repr(time.time() + allowed - GRACE_S)] + (["--dry-run"] if args.dry_run else [])
    return run_child(command, result, allowed, env)


def summary(name: str, entry: Mapping[str, Any]) -> str:
    """A few words after a section's status line on stdout."""
    results = entry["results"]
    if name == "tests" and "counts" in results:
        return " (" + ", ".join(f"{count} {outcome}" for outcome, count in results["counts"].items()) + ")"
    if entry["errors"]:
        return f" ({len(entry['errors'])} errors: {', '.join(e['unit'] for e in entry['errors'][:4])})"
    return ""


if __name__ == "__main__":
    sys.exit(main())
