"""The GPU check's report in markdown (benchmarks/gpu_check.py writes it beside report.json): a header naming the
machine and the tree, then each section's status, notes, table of figures, errors and the end of its output."""
from typing import Any, Callable, Dict, List, Mapping, Sequence

from benchmarks.gpu_sections import CHUNKS, GRAD_RTOL, LOSS_RTOL


def number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def scientific(value: Any) -> str:
    """A small figure (an error, a difference) as ``1.2e-03``; None (not finite, or not measured): ``n/a``."""
    return "n/a" if value is None else f"{value:.1e}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def tests_table(results: Mapping[str, Any]) -> List[str]:
    lines = [f"`{results.get('command', 'pytest')}`: exit {results.get('exit_code', 'n/a')}; "
             + ", ".join(f"{count} {outcome}" for outcome, count in results.get("counts", {}).items()), ""]
    rows = [[f"`{test}`", entry["outcome"], f"{entry['seconds']:.2f}", entry.get("reason", "")]
            for test, entry in results.get("tests", {}).items()]
    return lines + table(["test", "outcome", "s", "reason"], rows)


def timing_rows(rows: Sequence[Mapping[str, Any]], first: Sequence[str]) -> List[List[str]]:
    return [[*(str(row[key]) for key in first), number(row["step_ms"], 2), number(row["vs_plain"]),
             number(row["vs_by_hand"]), number(row["peak_mib"], 1), number(row["memory_vs_plain"])] for row in rows]


TIMING_HEADERS = ["step ms", "/ plain", f"/ {CHUNKS} by hand", "peak MiB", "memory / plain"]


def gpipe_table(results: Mapping[str, Any]) -> List[str]:
    lines = [f"- {name}: {text}" for name, text in results.get("workloads", {}).items()] + [""]
    lines += table(["model", "precision", "configuration", *TIMING_HEADERS],
                   timing_rows(results.get("rows", []), ("model", "precision", "configuration")))
    return lines + ["", "(step: forward, the output's mean, backward; the median over interleaved rounds. Two "
                        "partitions share one GPU: the figure is GPipe's cost there, not a speed-up.)"]


def schedules_table(results: Mapping[str, Any]) -> List[str]:
    lines = [f"{results.get('workload', '')}", ""]
    lines += table(["schedule", "stages", *TIMING_HEADERS],
                   timing_rows(results.get("rows", []), ("schedule", "stages")))
    checks = results.get("checks", {})
    if checks:
        lines += ["", *table(["schedule", "loss", "plain loss", "loss rel. diff", "largest grad rel. err",
                              "predicted activation MiB"],
                             [[name, number(c["loss"], 6), number(c["plain_loss"], 6), scientific(c["loss_rel_diff"]),
                               scientific(c["grad_max_rel_err"]), number(c.get("predicted_mib"), 1)]
                              for name, c in checks.items()])]
    split = results.get("split_backward")
    if split:
        lines += ["", f"One zbv stage's backward ({split['layers']} blocks {split['width']} wide, micro-batch "
                      f"{split['batch']}, forward subtracted; median over {split['rounds']} rounds):", ""]
        lines += table(["backward", "ms", "/ one backward"],
                       [[name, number(split["backward_ms"][name]), number(ratio)]
                        for name, ratio in split["ratios"].items()])
    return lines


def language_models_table(results: Mapping[str, Any]) -> List[str]:
    lines = [f"{results.get('workload', '')}", ""]
    rows = []
    for name, c in results.get("models", {}).items():
        rows.append([name, number(c["ok"]), number(c["loss_plain"], 4), number(c["loss_pipeline"], 4),
                     scientific(c["loss_rel_diff"]), scientific(c["grad_max_rel_err"]),
                     scientific(c["bf16_vs_float32_grad_max_rel_err"]),
                     number(c.get("tokens_per_s_plain"), 0), number(c.get("tokens_per_s_pipeline"), 0),
                     number(c.get("peak_mib_plain"), 1), number(c.get("peak_mib_pipeline"), 1)])
    lines += table(["model", "within tolerance", "loss plain", "loss Pipeline", "loss rel. diff",
                    "largest grad rel. err", "bf16 vs float32 (plain)", "tokens/s plain", "tokens/s Pipeline",
                    "peak MiB plain", "peak MiB Pipeline"], rows)
    return lines + ["", f"(tolerances: loss {LOSS_RTOL:.0e}, each gradient {GRAD_RTOL:.0e} relative, in norm; "
                        "'bf16 vs float32': the largest error bf16 itself gives the plain model's gradients)"]


def distributed_table(results: Mapping[str, Any]) -> List[str]:
    lines = [f"{results.get('workload', '')}", ""]
    rows = []
    for run, measured in results.get("runs", {}).items():
        for name, r in measured.items():
            rival = r.get("vs_rival") or r.get("burst_vs_rival")
            rows.append([run, name, number(r.get("speedup")), number(r.get("of_ideal")),
                         number(r.get("machine_line")),
                         f"{rival['ratio']:.3f} ({rival['ahead']}/{rival['rounds']})" if rival else "",
                         number(r.get("pipe_ms"), 2), number(r.get("pipe_burst_ms"), 2), number(r.get("plain_ms"), 2),
                         number(r.get("hand_ms"), 2)])
    lines += table(["run", "configuration", "speed-up vs plain", "of ideal", "machine line", "vs pipelining",
                    "step ms", "back to back ms", "plain ms", "by hand ms"], rows)
    return lines + ["", "(see benchmarks/distributed.py's docstring for each figure)"]


RENDERERS: Dict[str, Callable[[Mapping[str, Any]], List[str]]] = {
    "tests": tests_table, "gpipe": gpipe_table, "schedules": schedules_table,
    "language_models": language_models_table, "distributed": distributed_table,
}


def markdown(report: Mapping[str, Any]) -> str:
    h = report["header"]
    lines = [f"# torchpipe GPU check{' (dry run on the CPU)' if h['dry_run'] else ''}", ""]
    lines += table(["", ""], [
        ["device", h["device"]],
        ["torch", f"{h['torch']}, CUDA {h['cuda'] or 'none'}, cuDNN {h['cudnn'] or 'none'}; float32 matmul "
                  f"precision {h.get('float32_matmul_precision', 'n/a')}"],
        ["python", h["python"]],
        ["transformers, pytest", f"{h['transformers'] or 'not installed'}, {h['pytest'] or 'not installed'}"],
        ["commit", h["commit"] or "unknown (no git checkout here)"],
        ["source fingerprint", f"{h['source_fingerprint']} (`python benchmarks/gpu_check.py --fingerprint`)"],
        ["machine", h["machine"]],
        ["started", h["started"]],
        ["budget, wall time", f"{h['budget_s']:.0f} s, {number(report['wall_s'], 0)} s"
                              f"{'' if report['finished'] else ' (not finished)'}"],
        ["command", f"`{h['command']}`"],
    ])
    for name, entry in report["sections"].items():
        lines += ["", f"## {entry['title']}", ""]
        timing = "" if entry["seconds"] is None else f" in {entry['seconds']:.0f} s of {entry['budget_s']:.0f} s"
        lines += [f"**{entry['status']}**{timing}"]
        if entry["notes"]:
            lines += ["", *(f"- {note}" for note in entry["notes"])]
        if entry["results"]:
            try:
                lines += ["", *RENDERERS[name](entry["results"])]
            except (KeyError, TypeError, ValueError) as error:  # figures of a section cut short: the JSON has them
                lines += ["", f"(its figures could not be laid out: {error!r}; report.json has them)"]
        for e in entry["errors"]:
            lines += ["", f"Error in {e['unit']}:", "", "```", e["error"], "```"]
        if entry["log"]:
            lines += ["", "The end of its output:", "", "```", entry["log"], "```"]
    return "\n".join(lines) + "\n"
