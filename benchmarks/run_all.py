"""Runs the benchmarks, each in its own process, and writes the figures of their last run to benchmarks/RESULTS.md.

    python benchmarks/run_all.py [--preset small|paper|tiny] [--only overhead distributed ...] [--out out/bench]
                                 [--results benchmarks/RESULTS.md] [--jobs 1]

Each benchmark writes its JSON (and speed's and memory's plots and timelines) to ``--out``, and its output to
``--out``/NAME.log. ``RESULTS.md`` holds one section per benchmark: the machine, date, commit and command of its
last run, and one table of its figures (the benchmark's ``summary`` of its JSON). A benchmark that is not run
(``--only``, a package it needs is missing) or fails keeps the section of its previous run.

Presets: ``small`` (``make bench``: the CPU sizes, every benchmark), ``paper`` (speed, memory and the U-Net at
the GPipe papers' GPU sizes, every other benchmark with its own defaults) and ``tiny`` (the smallest sizes and one
round: it only checks that every benchmark runs and reports, as tests/test_benchmarks.py does; its figures mean
nothing, so it writes its RESULTS.md into ``--out`` unless ``--results`` says otherwise). ``--jobs`` runs that
many benchmarks at a time, for the tiny preset only: benchmarks that run at once slow each other down.
"""
import argparse
import datetime
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import ROOT  # noqa: E402
from benchmarks.harness.output import Summary, markdown_table  # noqa: E402
from benchmarks.harness.processes import child_environment  # noqa: E402

PRESETS = ("small", "paper", "tiny")
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
#: Where a section of RESULTS.md starts: the benchmark's name and its run's facts, as JSON.
MARKER = re.compile(r"^<!-- benchmark: (\S+) (\{.*\}) -->$")


@dataclass(frozen=True)
class Benchmark:
    """A script of benchmarks/ and its command-line arguments per preset (``{out}``: the results' folder); it
    writes its JSON where ``--json`` says, and its module's ``summary(results)`` makes its table."""

    name: str
    arguments: Mapping[str, Sequence[str]]
    #: Modules it imports that a machine may lack: without them it is skipped.
    needs: Tuple[str, ...] = ()
    #: Arguments for every preset.
    common: Sequence[str] = field(default_factory=tuple)

    @property
    def script(self) -> Path:
        return ROOT / "benchmarks" / f"{self.name}.py"

    def command(self, preset: str, out: Path) -> List[str]:
        arguments = [*self.common, *self.arguments[preset], "--json", str(out / f"{self.name}.json")]
        return [str(self.script)] + [argument.format(out=out) for argument in arguments]


BENCHMARKS: List[Benchmark] = [
    Benchmark("speed", {
        "small": ["--preset", "small", "--plot", "{out}/speed.png", "--timeline", "{out}/timeline"],
        "paper": ["--preset", "paper", "--plot", "{out}/speed.png", "--timeline", "{out}/timeline"],
        "tiny": ["--preset", "tiny", "--models", "unet", "resnet50-traced", "--rounds", "1", "--warmup", "0",
                 "--balance", "even"],
    }, common=["--quiet"]),
    Benchmark("memory", {
        "small": ["--preset", "small", "--budget-mb", "256", "--budget-models", "unet", "--plot", "{out}/memory.png"],
        "paper": ["--preset", "paper", "--budget-mb", "256", "--budget-models", "unet", "--plot", "{out}/memory.png"],
        "tiny": ["--preset", "tiny", "--models", "unet", "--chunks", "2", "--modes", "except_last", "--budget-mb", "1",
                 "--budget-models", "unet", "--max-batch", "16"],
    }, common=["--quiet"]),
    Benchmark("unet_skip", {
        "small": ["--preset", "small"],
        "paper": ["--preset", "paper"],
        "tiny": ["--preset", "tiny", "--configs", "2x2", "--rounds", "1", "--warmup", "0"],
    }, common=["--quiet"]),
    Benchmark("overhead", {"small": [], "paper": [],
                           "tiny": ["--rounds", "1", "--batch", "16", "--layers", "4", "--width", "16"]}),
    Benchmark("schedules", {
        "small": ["--models", "mlp"],
        "paper": [],
        "tiny": ["--models", "mlp-tiny", "--rounds", "1", "--chunks", "4", "--schedules", "zero_bubble", "zbv"],
    }),
    Benchmark("distributed", {
        "small": ["--rounds", "5"],
        "paper": [],
        "tiny": ["--quick", "--configs", "torchpipe 1f1b", "pipelining Schedule1F1B", "torchpipe auto"],
    }),
    Benchmark("stage_memory", {"small": ["--rounds", "5"], "paper": [], "tiny": ["--quick"]}),
    Benchmark("mesh", {"small": ["--rounds", "5"], "paper": [], "tiny": ["--quick", "--models", "wide"]},
              common=["--quiet"]),
    Benchmark("tensor_parallel", {"small": ["--rounds", "9"], "paper": [], "tiny": ["--quick"]}),
    Benchmark("language_model", {
        "small": [], "paper": [],
        "tiny": ["--rounds", "1", "--layers", "1", "--width", "16", "--batch", "2", "--length", "4"],
    }, needs=("transformers",)),
    Benchmark("lm_pipeline", {"small": ["--rounds", "9"], "paper": [], "tiny": ["--quick"]}, needs=("transformers",)),
    Benchmark("compiled", {"small": [], "paper": [], "tiny": ["--quick", "--rounds", "1", "--warmup", "0", "--backend",
                                                              "aot_eager"]}, needs=("transformers",)),
    Benchmark("data_parallel", {
        "small": [], "paper": [], "tiny": ["--width", "16", "--depth", "2", "--batch", "8", "--repeats", "1"],
    }),
    Benchmark("balance_solver", {"small": [], "paper": [], "tiny": ["--layers", "500", "--partitions", "8"]}),
]
NAMES = [benchmark.name for benchmark in BENCHMARKS]


def commit() -> str:
    """The checkout's commit, and whether files it tracks (RESULTS.md aside) differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":(exclude)benchmarks/RESULTS.md"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if changed else "")


def load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def run(benchmark: Benchmark, preset: str, out: Path, stream: bool = True) -> Tuple[int, float, str]:
    """Runs ``benchmark`` in its own process, its output kept in ``out``/NAME.log (and shown, with ``stream``):
    (its exit status, seconds, the command as a user types it)."""
    command = benchmark.command(preset, out)
    shown = " ".join(shlex.quote(os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a)
                     for a in ["python"] + command)
    print(f"\n=== {benchmark.name}: {shown}", flush=True)
    start = time.perf_counter()
    with open(out / f"{benchmark.name}.log", "w", encoding="utf-8") as log:
        child = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=child_environment(PYTHONUNBUFFERED="1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert child.stdout is not None
        for line in child.stdout:
            if stream:
                sys.stdout.write(line)
            log.write(line)
        status = child.wait()
    seconds = time.perf_counter() - start
    print(f"=== {benchmark.name}: exit {status} in {seconds:.0f} s", flush=True)
    return status, seconds, shown


def attempt(benchmark: Benchmark, preset: str, out: Path, stream: bool = True) -> Optional[Tuple[Dict[str, Any], str]]:
    """Runs ``benchmark``: its run's facts and its section of RESULTS.md, or None where it failed (its process, or
    its summary of the JSON it wrote)."""
    json_path = out / f"{benchmark.name}.json"
    json_path.unlink(missing_ok=True)  # an earlier run's is not this one's
    load = load_average()
    status, seconds, command = run(benchmark, preset, out, stream)
    if status != 0 or not json_path.exists():
        return None
    results = json.loads(json_path.read_text(encoding="utf-8"))
    facts = {"machine": results.get("machine", "unknown"), "load": load, "commit": commit(),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "preset": preset, "seconds": round(seconds), "command": command}
    try:
        return facts, section(benchmark.name, facts, summarise(benchmark.name, results)) + "\n"
    except Exception:  # a summary that cannot read its benchmark's JSON: that benchmark failed
        traceback.print_exc()
        return None


def summarise(name: str, results: Mapping[str, Any]) -> Summary:
    """The benchmark's own ``summary`` of its results; where it has none, every figure of the JSON by its path."""
    module = importlib.import_module(f"benchmarks.{name}")
    made = getattr(module, "summary", None)
    if made is not None:
        summary = made(results)
        assert isinstance(summary, Summary), f"benchmarks.{name}.summary returned {type(summary).__name__}"
        return summary
    rows: List[List[Any]] = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{path}.{key}" if path else str(key), inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append([path, value])

    walk("", {key: value for key, value in results.items() if key != "machine"})
    return Summary(["figure", "value"], rows)


def section(name: str, facts: Mapping[str, Any], summary: Summary) -> str:
    """A benchmark's section of RESULTS.md: its marker, heading, what it measures, its run's facts, its table."""
    module = importlib.import_module(f"benchmarks.{name}")
    what = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    load = f", load average {facts['load']}" if facts.get("load") is not None else ""
    return "\n\n".join([
        f"<!-- benchmark: {name} {json.dumps(dict(facts), sort_keys=True)} -->\n## {name}",
        what,
        f"Machine: {facts['machine']}{load}. Run {facts['date']} at commit {facts['commit']}, preset "
        f"{facts['preset']}, in {facts['seconds']:.0f} s: `{facts['command']}`.",
        summary.markdown(),
    ])


def read_sections(path: Path) -> Dict[str, Tuple[Dict[str, Any], str]]:
    """The sections of an existing RESULTS.md, by benchmark: (its run's facts, its text)."""
    sections: Dict[str, Tuple[Dict[str, Any], str]] = {}
    if not path.exists():
        return sections
    name: Optional[str] = None
    for line in path.read_text(encoding="utf-8").splitlines():
        found = MARKER.match(line)
        if found:
            name = found.group(1)
            sections[name] = (json.loads(found.group(2)), line)
        elif name is not None:
            facts, text = sections[name]
            sections[name] = (facts, text + "\n" + line)
    return {name: (facts, text.rstrip() + "\n") for name, (facts, text) in sections.items()}


def write_results(path: Path, sections: Mapping[str, Tuple[Dict[str, Any], str]]) -> None:
    """RESULTS.md: the header, an index of the sections, then each benchmark's section in BENCHMARKS' order."""
    order = [name for name in NAMES if name in sections] + sorted(set(sections) - set(NAMES))
    index = []
    for name in order:
        facts = sections[name][0]
        load = None if facts.get("load") is None else f"{facts['load']:.1f}"
        index.append([f"[{name}](#{name})", facts["preset"], facts["date"], facts["commit"], facts["machine"], load,
                      facts["seconds"]])
    header = "\n\n".join([
        "# Benchmark results",
        "<!-- Generated by benchmarks/run_all.py: do not edit by hand. -->",
        "Generated by `python benchmarks/run_all.py` (`make bench`); do not edit this file by hand. Each section "
        "holds the figures of its benchmark's last run, with the machine, date and commit it ran on; "
        "`python benchmarks/run_all.py --only NAME` runs one again and replaces its section. What each benchmark "
        "measures, and what its ratios are measured against, is in [README.md](README.md).",
        markdown_table(["benchmark", "preset", "finished", "commit", "machine", "load average at its start", "s"],
                       index),
    ])
    body = "\n".join(sections[name][1] for name in order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n\n" + body, encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="small")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=None, help="run only these benchmarks")
    parser.add_argument("--out", default=str(ROOT / "out" / "bench"), help="JSON, plots and logs go here")
    parser.add_argument("--results", default=None, help="the RESULTS.md to update (default: benchmarks/RESULTS.md; "
                        "for the tiny preset, RESULTS.md in --out)")
    parser.add_argument("--jobs", type=int, default=1, help="benchmarks at a time (more than 1: tiny only)")
    args = parser.parse_args(argv)
    if args.jobs > 1 and args.preset != "tiny":
        parser.error("--jobs: benchmarks that run at once slow each other down; more than 1 only for --preset tiny")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = Path(args.results) if args.results else out / "RESULTS.md" if args.preset == "tiny" else RESULTS
    sections = read_sections(results_path)
    failed, skipped = [], []
    started = time.perf_counter()
    chosen = []
    for benchmark in BENCHMARKS:
        if args.only and benchmark.name not in args.only:
            continue
        missing = [module for module in benchmark.needs if importlib.util.find_spec(module) is None]
        if missing:
            print(f"\n=== {benchmark.name}: skipped (needs {', '.join(missing)})", flush=True)
            skipped.append(benchmark.name)
        else:
            chosen.append(benchmark)
    lock = threading.Lock()

    def one(benchmark: Benchmark) -> None:
        made = attempt(benchmark, args.preset, out, stream=args.jobs == 1)
        with lock:
            if made is None:
                failed.append(benchmark.name)
                return
            sections[benchmark.name] = made
            write_results(results_path, sections)  # after every benchmark: a run cut short keeps what it measured

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, chosen))
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{minutes:.1f} minutes; results in {results_path}, JSON and logs in {out}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else "")
          + (f"; FAILED: {', '.join(sorted(failed))}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
