"""The GPU check's sections: what each one measures, in the child process that runs it (benchmarks/gpu_check.py).

A section is a function of a :class:`Child`, which holds the device, the
:class:`Sizes` of the run (the GPU's or the dry run's) and the section's
deadline, and saves the results after every unit of work, so that a child
stopped half-way leaves what it had measured. A unit that raises is recorded
with the end of its traceback and the section goes on with the next one.
"""
import copy
import functools
import importlib.util
import json
import math
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from benchmarks import models
from benchmarks.experiments import split_backward
from benchmarks.harness import ROOT
from benchmarks.harness.machine import cores
from benchmarks.harness.memory import step_peak_bytes
from benchmarks.harness.steps import Step, drop_grads, microbatched_train_step, pipeline_step, train_step
from benchmarks.harness.timing import Variant, median_ratio, round_robin
from torchpipe.schedule import LOOPED, V_SHAPED

MiB = 1024 * 1024
#: Micro-batches of the GPipe and Pipeline figures.
CHUNKS = 8
#: bf16 tolerances of section 4: the loss's relative difference, and each gradient's (the norm of the difference
#: over the plain gradient's norm). bf16 keeps 8 bits of mantissa (a relative step of 2**-8 = 0.4%), and the
#: Pipeline adds the micro-batches' gradients in bf16 where the plain model sums inside one product.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2
#: float32 tolerances of section 3 (the same arithmetic as the plain module's, on micro-batches).
FLOAT32_RTOL = 1e-4

T = TypeVar("T")


# --- sizes ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The models, batches and rounds of one run: the GPU's, or the dry run's (tiny, on the CPU)."""

    mlp: Tuple[int, int, int]  # layers, width, batch
    transformer: Tuple[int, int, int, int, int, int]  # layers, width, heads, vocab, length, batch
    language_model: Tuple[int, int, int, int, int, int, int]  # layers, width, heads, vocab, length, batch, chunks
    rounds: int
    warmup: int
    pytest_args: Tuple[str, ...]
    #: benchmarks/distributed.py: the batches of its main measurement, its rounds, and (None: not run) the rounds
    #: of its fixed cost.
    distributed_batches: Tuple[int, ...]
    distributed_rounds: int
    distributed_fixed_rounds: Optional[int]


GPU = Sizes(
    mlp=(32, 1024, 8192),
    transformer=(8, 512, 8, 4096, 256, 64),
    language_model=(4, 512, 8, 8192, 256, 16, 4),
    rounds=7,
    warmup=2,
    pytest_args=("-m", "cuda", "tests"),
    distributed_batches=(256, 1024),
    distributed_rounds=6,
    distributed_fixed_rounds=16,
)
DRY = Sizes(
    mlp=(4, 32, 64),
    transformer=(2, 32, 2, 64, 16, 16),
    language_model=(2, 32, 4, 64, 16, 8, 4),
    rounds=1,
    warmup=1,
    # Two tests that run on the CPU, and one that a machine without CUDA skips.
    pytest_args=("tests/test_transparency.py::test_mlp_over_three_partitions[cpu-4-always]",
                 "tests/test_transparency.py::test_mlp_over_three_partitions[cpu-16-never]",
                 "tests/test_cuda.py::test_two_partitions_on_one_gpu[always]"),
    distributed_batches=(16,),
    distributed_rounds=1,
    distributed_fixed_rounds=None,
)


# --- a section's side, in its child process -----------------------------------------------------------------


class Child:
    """What a section's child measures, saved to ``path`` after every unit (a child stopped half-way leaves what
    it had measured), with each unit's error and the notes the report prints under the section."""

    def __init__(self, path: Path, sizes: Sizes, device: torch.device, deadline: float) -> None:
        self.path = path
        self.sizes = sizes
        self.device = device
        self.deadline = deadline
        self.results: Dict[str, Any] = {}
        self.errors: List[Dict[str, str]] = []
        self.notes: List[str] = []
        self.skipped: Optional[str] = None

    def left(self) -> float:
        """Seconds until this section's own deadline."""
        return self.deadline - time.time()

    def save(self) -> None:
        data = {"results": self.results, "errors": self.errors, "notes": self.notes, "skipped": self.skipped}
        write_atomically(self.path, json.dumps(data, default=str))

    def error(self, unit: str, message: str) -> None:
        self.errors.append({"unit": unit, "error": message})
        self.save()

    def attempt(self, unit: str, work: Callable[[], T]) -> Optional[T]:
        """``work()``, or None when it raised (its traceback's end is recorded) or the section's time is spent."""
        if self.left() <= 0:
            self.notes.append(f"{unit}: not run, the section's time was spent")
            self.save()
            return None
        try:
            return work()
        except Exception:  # noqa: BLE001 - the report records it; the section goes on with its next unit
            self.error(unit, tail(traceback.format_exc(), 12))
            return None
        finally:
            self.save()


def write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file, so that a reader never sees half of it."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def finite(value: float) -> Optional[float]:
    """``value``, or None where it is not a finite number (JSON has no NaN)."""
    return value if math.isfinite(value) else None


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """The norm of the difference over the norm of ``expected`` (in float64); 0 where both are 0."""
    difference = float((actual.double() - expected.double()).norm())
    norm = float(expected.double().norm())
    return difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)


# --- 1. the CUDA tests --------------------------------------------------------------------------------------


class TestRecorder:
    """A pytest plugin: every test's outcome, saved to the section's results as each test starts and ends (a test
    that crashes the process or hangs stays ``running``)."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.tests: Dict[str, Dict[str, Any]] = {}
        child.results["tests"] = self.tests

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.tests[nodeid] = {"outcome": "running", "seconds": 0.0}
        self.child.save()

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "running", "seconds": 0.0})
        entry["seconds"] += report.duration
        if report.failed:
            # A failure in the call is the test's; one in set-up or tear-down is an error, as pytest counts it.
            entry["outcome"] = "failed" if report.when == "call" else "error"
            self.child.errors.append({"unit": report.nodeid, "error": tail(str(report.longrepr), 15)})
        elif report.skipped and entry["outcome"] == "running":
            entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
            if isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
                entry["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.when == "call" and entry["outcome"] == "running":
            entry["outcome"] = "xpassed" if hasattr(report, "wasxfail") else "passed"
        if report.when == "teardown":
            self.child.save()

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.tests[report.nodeid or "collection"] = {"outcome": "error", "seconds": 0.0}
            self.child.error(f"collecting {report.nodeid}", tail(str(report.longrepr), 15))


def run_tests(child: Child) -> None:
    import pytest

    args = ["-p", "no:cacheprovider", "-q", *child.sizes.pytest_args]
    if importlib.util.find_spec("pytest_timeout") is not None:
        args += ["-o", "timeout=120"]  # a test that hangs fails alone instead of taking the section's time
    child.results["command"] = "pytest " + " ".join(args)
    recorder = TestRecorder(child)
    os.chdir(ROOT)
    code = int(pytest.main(args, plugins=[recorder]))
    outcomes = [entry["outcome"] for entry in recorder.tests.values()]
    child.results["exit_code"] = code
    child.results["counts"] = {outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))}
    if code not in (0, 1):  # 1: some tests failed (recorded one by one); 2 to 5: pytest's own trouble
        child.error("pytest", f"pytest exited with {code} ({pytest.ExitCode(code).name})")
    child.save()


# --- 2. GPipe ----------------------------------------------------------------------------------------------


class Autocast(nn.Module):
    """Runs the wrapped module under ``torch.autocast(..., dtype=torch.bfloat16)``; GPipe's and Pipeline's
    workers take the caller's autocast state."""

    def __init__(self, module: nn.Module, device_type: str) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type

    def forward(self, input: Tensor) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(input)


PRECISIONS = ("float32", "bf16 autocast")
#: (name, partitions, micro-batches, checkpoint); ``except_last`` on one partition is ``never``.
GPIPE_CONFIGS: List[Tuple[str, int, int, str]] = [
    ("1 partition x 1, never", 1, 1, "never"),
    ("1 partition x 1, always", 1, 1, "always"),
    (f"1 partition x {CHUNKS}, never", 1, CHUNKS, "never"),
    (f"1 partition x {CHUNKS}, always", 1, CHUNKS, "always"),
    (f"2 partitions x {CHUNKS}, never", 2, CHUNKS, "never"),
    (f"2 partitions x {CHUNKS}, except_last", 2, CHUNKS, "except_last"),
    (f"2 partitions x {CHUNKS}, always", 2, CHUNKS, "always"),
]
PLAIN = "plain"
BY_HAND = f"{CHUNKS} micro-batches by hand"


def gpipe_workload(name: str, sizes: Sizes, device: torch.device) -> Tuple[nn.Sequential, Tensor]:
    if name == "mlp":
        layers, width, batch = sizes.mlp
        return models.mlp(layers, width).to(device), torch.randn(batch, width, device=device)
    layers, width, heads, vocab, length, batch = sizes.transformer
    module = models.transformer(layers, width, heads, vocab).to(device)
    return module, torch.randint(0, vocab, (batch, length), device=device)


def describe_workload(name: str, sizes: Sizes) -> str:
    if name == "mlp":
        layers, width, batch = sizes.mlp
        return f"{layers} Linear+ReLU pairs of width {width}, batch {batch}"
    layers, width, heads, vocab, length, batch = sizes.transformer
    return (f"{layers} pre-norm encoder blocks of width {width}, {heads} heads, vocabulary {vocab}, batch {batch} x "
            f"{length} tokens")


@dataclass
class Measured:
    """Steps timed round by round (every step once a round, the order rotating) and each one's peak memory."""

    times: Dict[str, List[float]]
    peaks: Dict[str, Optional[int]]

    def __contains__(self, name: str) -> bool:
        return name in self.times

    def step_ms(self, name: str) -> float:
        return statistics.median(self.times[name]) * 1e3

    def over(self, name: str, yardstick: Optional[str]) -> Optional[float]:
        """The median over rounds of ``name``'s time over ``yardstick``'s in the same round (None: not measured)."""
        if yardstick is None or yardstick not in self or name not in self:
            return None
        return median_ratio(self.times, name, yardstick)

    def peak_mib(self, name: str) -> Optional[float]:
        return ratio(self.peaks.get(name), MiB)

    def memory_over(self, name: str, yardstick: str) -> Optional[float]:
        return ratio(self.peaks.get(name), self.peaks.get(yardstick))

    def row(self, name: str, by_hand: Optional[str]) -> Dict[str, Any]:
        """The figures of a table's row: over the plain step and (where given) over the micro-batches by hand."""
        return {"step_ms": self.step_ms(name), "vs_plain": self.over(name, PLAIN) if name != PLAIN else None,
                "vs_by_hand": self.over(name, by_hand), "peak_mib": self.peak_mib(name),
                "memory_vs_plain": self.memory_over(name, PLAIN) if name != PLAIN else None}


def run_once(step: Step) -> bool:
    step()
    return True


def measure_steps(child: Child, unit: str, steps: Mapping[str, Step]) -> Measured:
    """Each step's times and peak memory. A step is tried once first: one that raises is recorded as an error of
    its own and left out, so that the others are still measured."""
    working = {name: step for name, step in steps.items()
               if child.attempt(f"{unit}: {name}", functools.partial(run_once, step))}
    variants = [Variant(name, step) for name, step in working.items()]
    times = child.attempt(f"{unit}: timing", functools.partial(
        round_robin, variants, rounds=child.sizes.rounds, warmup=child.sizes.warmup, device=child.device,
        quiet=True)) if variants else None
    if times is None:
        return Measured({}, {})
    peaks = {name: child.attempt(f"{unit}: {name}: memory", functools.partial(step_peak_bytes, step, child.device))
             for name, step in working.items()}
    return Measured(times, peaks)


def gpipe_unit(child: Child, model: str, precision: str) -> None:
    unit = f"{model}, {precision}"
    module, x = gpipe_workload(model, child.sizes, child.device)

    def wrap(m: nn.Module) -> nn.Module:
        return Autocast(m, child.device.type) if precision != "float32" else m

    steps = {PLAIN: train_step(wrap(module), x), BY_HAND: microbatched_train_step(wrap(module), x, CHUNKS)}
    for name, partitions, chunks, checkpoint in GPIPE_CONFIGS:
        built = child.attempt(f"{unit}: {name}: GPipe", functools.partial(
            build_gpipe, module, partitions, chunks, checkpoint, child.device))
        if built is not None:
            steps[name] = train_step(wrap(built), x)
    measured = measure_steps(child, unit, steps)
    rows = child.results.setdefault("rows", [])
    for name, partitions, chunks, checkpoint in [(PLAIN, 1, 1, "-"), (BY_HAND, 1, CHUNKS, "-")] + GPIPE_CONFIGS:
        if name in measured:
            # Over the same micro-batches by hand where there are several of them.
            by_hand = BY_HAND if chunks > 1 and name != BY_HAND else None
            rows.append({"model": model, "precision": precision, "configuration": name, "partitions": partitions,
                         "chunks": chunks, "checkpoint": checkpoint, **measured.row(name, by_hand)})
    child.save()


def build_gpipe(module: nn.Sequential, partitions: int, chunks: int, checkpoint: str,
                device: torch.device) -> torchpipe.GPipe:
    """A GPipe of a copy of ``module``: an even split into ``partitions``, every one on ``device``."""
    return torchpipe.GPipe(copy.deepcopy(module), models.even_balance(len(module), partitions),
                           devices=[device] * partitions, chunks=chunks, checkpoint=checkpoint)


def run_gpipe(child: Child) -> None:
    child.results["workloads"] = {name: describe_workload(name, child.sizes) for name in ("mlp", "transformer")}
    for model in ("mlp", "transformer"):
        for precision in PRECISIONS:
            child.attempt(f"{model}, {precision}", functools.partial(gpipe_unit, child, model, precision))
            release(child.device)


def release(device: torch.device) -> None:
    """Frees what a unit left in PyTorch's CUDA cache, so that the next unit starts alike."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --- 3. Pipeline schedules ----------------------------------------------------------------------------------


#: Stages per worker of a built-in schedule (the others: one), for two workers: two on the loop and in the V.
STAGES_PER_WORKER = {name: 2 for name in LOOPED + V_SHAPED}
#: The split backward's rounds, per round of the sizes' (a stage's backward is short: many rounds fit).
SPLIT_BACKWARD_ROUNDS = 20


def schedule_unit(child: Child, name: str, module: nn.Sequential, x: Tensor, y: Tensor, loss: float,
                  grads: Mapping[str, Tensor], checkpoint: str = "never", recompute: str = "full") -> Step:
    """A two-worker Pipeline of ``name`` checked against the plain module's loss and gradients, and its step;
    with ``checkpoint``, named ``'<name> checkpoint=<checkpoint> recompute=<recompute>'``."""
    from torchpipe.schedule.split import TUNING_STEPS

    stages = 2 * STAGES_PER_WORKER.get(name, 1)
    pipe = torchpipe.Pipeline(copy.deepcopy(module), models.even_balance(len(module), stages), chunks=CHUNKS,
                              schedule=name, loss_fn=F.mse_loss, devices=[child.device, child.device],
                              checkpoint=checkpoint, recompute=recompute)
    if checkpoint != "never":
        name = f"{name} checkpoint={checkpoint} recompute={recompute}"
    got = float(pipe.step(x, y))
    predicted = sum(pipe.memory().predicted_peak.values())  # both workers: one GPU
    # A Pipeline names its parameters as the plain Sequential does ("3.weight"); one without a gradient: inf.
    errors = {key: relative_error(p.grad, grads[key]) if p.grad is not None and key in grads else math.inf
              for key, p in pipe.named_parameters()}
    worst = max(errors.values(), default=math.inf)
    loss_rel_diff = abs(got - loss) / abs(loss)
    check = {"stages": stages, "loss": finite(got), "plain_loss": loss, "loss_rel_diff": finite(loss_rel_diff),
             "grad_max_rel_err": finite(worst), "predicted_mib": predicted / MiB}
    child.results.setdefault("checks", {})[name] = check
    if not (loss_rel_diff <= FLOAT32_RTOL and worst <= FLOAT32_RTOL):  # NaN fails too
        child.error(name, f"the Pipeline's loss {got:.6g} or gradients differ from the plain module's (loss "
                          f"{loss:.6g}, relative {loss_rel_diff:.2e}; the largest gradient's relative error "
                          f"{worst:.2e}; tolerance {FLOAT32_RTOL:.0e})")
    drop_grads(pipe)
    if name == "zero_bubble":  # its split is chosen on its first steps: timed after them
        for _ in range(TUNING_STEPS):
            pipe.step(x, y)
            drop_grads(pipe)

    return pipeline_step(pipe, x, y)


def run_schedules(child: Child) -> None:
    from torchpipe.schedule import NAMES

    layers, width, batch = child.sizes.mlp
    child.results["workload"] = f"{describe_workload('mlp', child.sizes)}, MSE loss, float32, {CHUNKS} micro-batches"
    module = models.mlp(layers, width).to(child.device)
    x = torch.randn(batch, width, device=child.device)
    y = torch.randn(batch, width, device=child.device)
    loss = F.mse_loss(module(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {key: p.grad.clone() for key, p in module.named_parameters() if p.grad is not None}
    drop_grads(module)

    steps: Dict[str, Step] = {
        PLAIN: train_step(module, x, target=y, loss_fn=F.mse_loss),
        BY_HAND: microbatched_train_step(module, x, CHUNKS, target=y, loss_fn=F.mse_loss)}
    for name in NAMES:
        step = child.attempt(name, functools.partial(schedule_unit, child, name, module, x, y, float(loss), grads))
        if step is not None:
            steps[name] = step
    for recompute in ("full", "selective"):  # the memory and time of recomputation, against 1f1b's
        label = f"1f1b checkpoint=always recompute={recompute}"
        step = child.attempt(label, functools.partial(schedule_unit, child, "1f1b", module, x, y, float(loss),
                                                      grads, "always", recompute))
        if step is not None:
            steps[label] = step
    measured = measure_steps(child, "schedules", steps)
    checks = child.results.get("checks", {})
    child.results["rows"] = [
        {"schedule": name, "stages": checks[name]["stages"] if name in checks else 1,
         **measured.row(name, BY_HAND if name not in (PLAIN, BY_HAND) else None)}
        for name in steps if name in measured]
    child.save()
    release(child.device)
    # One zbv stage's split backward against its one backward (benchmarks/experiments/split_backward.py): what the
    # split costs beyond the one backward is what zbv lacks against its machine line.
    stage_layers = max(1, layers // 4)
    child.results["split_backward"] = child.attempt("split backward", functools.partial(
        split_backward.run, SPLIT_BACKWARD_ROUNDS * child.sizes.rounds, stage_layers, max(1, batch // CHUNKS), width,
        child.device, quiet=True))
    child.save()


# --- 4. Hugging Face language models ------------------------------------------------------------------------


LANGUAGE_MODELS = ("gpt2", "llama")
PIPELINE = "Pipeline 1f1b"


def language_model(name: str, sizes: Sizes) -> nn.Module:
    """A GPT-2 (embedding and head tied) or a Llama from a transformers config, float32, seed 0."""
    import transformers

    transformers.logging.set_verbosity_error()
    layers, width, heads, vocab, length, _, _ = sizes.language_model
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), vocab_size=vocab, max_position_embeddings=length, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, tie_word_embeddings=False))


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def language_model_unit(child: Child, name: str) -> None:
    layers, width, heads, vocab, length, batch, chunks = child.sizes.language_model
    device = child.device
    model = language_model(name, child.sizes)
    ids = torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)

    def loss_and_grads(module: nn.Module) -> Tuple[float, Dict[str, Tensor]]:
        loss = next_token_loss(module(input_ids=ids, use_cache=False).logits, ids)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {key: p.grad.clone() for key, p in module.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
        drop_grads(module)
        return float(loss), grads

    reference_loss, reference_grads = loss_and_grads(copy.deepcopy(model).to(device))  # float32: bf16's own error
    plain = model.to(device, torch.bfloat16)
    plain_loss, plain_grads = loss_and_grads(plain)
    sequential = torchpipe.as_sequential(copy.deepcopy(plain), input_ids=ids[:2], use_cache=False, output="logits")
    # The second stage starts at the middle block.
    prefix = f"transformer.h.{layers // 2}." if name == "gpt2" else f"model.layers.{layers // 2}."
    cut = next(k for k, layer in enumerate(sequential) if str(getattr(layer, "name", "")).startswith(prefix))
    pipe = torchpipe.Pipeline(sequential, [cut, len(sequential) - cut], chunks=chunks, schedule="1f1b",
                              loss_fn=next_token_loss, devices=[device, device])
    pipe_loss = float(pipe.step(ids, ids))
    # The Pipeline's parameter names are the plain model's, after the index of the layer that holds them.
    pipe_grads = {key.split(".", 1)[1]: p.grad for key, p in pipe.named_parameters(remove_duplicate=False)}
    missing = sorted(key for key, grad in pipe_grads.items() if grad is None or key not in plain_grads)
    errors = {key: relative_error(grad, plain_grads[key]) for key, grad in pipe_grads.items()
              if grad is not None and key in plain_grads}
    if not errors:
        raise RuntimeError(f"no parameter of the Pipeline has a gradient under a name of the plain model's: "
                           f"{sorted(pipe_grads)[:6]}... against {sorted(plain_grads)[:6]}...")
    worst = max(errors, key=lambda key: errors[key])
    bf16_cost = max(relative_error(plain_grads[key], reference_grads[key]) for key in plain_grads)
    drop_grads(pipe)
    loss_rel_diff = abs(pipe_loss - plain_loss) / abs(plain_loss)
    check = {
        "parameters": len(pipe_grads), "cut": cut, "layers_traced": len(sequential),
        "loss_plain": finite(plain_loss), "loss_pipeline": finite(pipe_loss), "loss_float32": finite(reference_loss),
        "loss_rel_diff": finite(loss_rel_diff), "grad_max_rel_err": finite(errors[worst]), "worst_parameter": worst,
        "bf16_vs_float32_grad_max_rel_err": finite(bf16_cost), "missing_gradients": missing,
        # NaN fails too.
        "ok": bool(loss_rel_diff <= LOSS_RTOL and errors[worst] <= GRAD_RTOL and not missing),
    }
    child.results.setdefault("models", {})[name] = check
    if not check["ok"]:
        child.error(name, f"the Pipeline's loss {pipe_loss:.5g} or gradients differ from the plain model's in bf16 "
                          f"beyond the tolerances (loss {plain_loss:.5g}, relative {loss_rel_diff:.2e} > "
                          f"{LOSS_RTOL:.0e}?; gradient of {worst} relative {errors[worst]:.2e} > {GRAD_RTOL:.0e}?; "
                          f"without a gradient: {missing or 'none'})")

    def plain_step() -> None:
        next_token_loss(plain(input_ids=ids, use_cache=False).logits, ids).backward()  # type: ignore
        drop_grads(plain)

    measured = measure_steps(child, name, {PLAIN: plain_step, PIPELINE: pipeline_step(pipe, ids, ids)})
    for variant, key in ((PLAIN, "plain"), (PIPELINE, "pipeline")):
        if variant in measured:
            check[f"tokens_per_s_{key}"] = batch * length / (measured.step_ms(variant) / 1e3)
            check[f"peak_mib_{key}"] = measured.peak_mib(variant)
    check["pipeline_vs_plain_time"] = measured.over(PIPELINE, PLAIN)
    child.save()


def run_language_models(child: Child) -> None:
    if importlib.util.find_spec("transformers") is None:
        child.skipped = "transformers is not installed here"
        return
    import transformers

    layers, width, heads, vocab, length, batch, chunks = child.sizes.language_model
    child.results["workload"] = (
        f"transformers {transformers.__version__}; {layers} blocks of width {width}, {heads} heads, vocabulary "
        f"{vocab}, batch {batch} x {length} tokens, next-token cross-entropy; weights in bf16; Pipeline of 2 stages "
        f"(the second from block {layers // 2}) on two workers of {child.device}, 1f1b, {chunks} micro-batches")
    for name in LANGUAGE_MODELS:
        child.attempt(name, functools.partial(language_model_unit, child, name))
        release(child.device)


# --- 5. the multi-process CPU benchmark ---------------------------------------------------------------------


def run_distributed(child: Child) -> None:
    from benchmarks import distributed

    sizes = child.sizes
    child.notes.append(f"{distributed.WORLD} gloo ranks of 1 intra-op thread on {cores()} cores, CUDA hidden; "
                       f"benchmarks/distributed.py has no world-size option (WORLD = {distributed.WORLD}): "
                       "no figures at 4 ranks")
    child.results["workload"] = (f"{distributed.LAYERS}x{distributed.WIDTH} Linear+ReLU MLP, MSE loss, "
                                 f"{distributed.CHUNKS} micro-batches; rounds: {sizes.distributed_rounds}")
    runs = child.results["runs"] = {}
    for batch in sizes.distributed_batches:
        measured = child.attempt(f"batch {batch}", functools.partial(
            distributed.measure, distributed.CONFIGS, batch, sizes.distributed_rounds,
            timeout=max(10.0, child.left()), burst=0 if sizes.distributed_fixed_rounds else 1))
        if measured is not None:
            runs[f"batch {batch}"] = measured
    if sizes.distributed_fixed_rounds is None:
        child.notes.append("dry run: the fixed cost's launch is left out (its steps back to back were timed once at "
                           "each batch instead)")
        return
    measured = child.attempt("fixed cost", functools.partial(
        distributed.measure, distributed.CONFIGS, distributed.FIXED_BATCH, sizes.distributed_fixed_rounds,
        timeout=max(10.0, child.left()), layers=distributed.FIXED_LAYERS, width=distributed.FIXED_WIDTH,
        burst=distributed.FIXED_BURST))
    if measured is not None:
        runs["fixed cost"] = measured
