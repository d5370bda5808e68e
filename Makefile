# The commands of the README: `make run` (a pipelined training run), `make test`,
# `make run-distributed` (a Pipeline trained over two processes, one stage each, under torchrun),
# `make run-resume` (the same job, a rank killed: torchrun restarts it and it resumes from its checkpoint) and
# `make run-mesh` (two data-parallel replicas of a two-stage Pipeline: four processes on a 2 x 2 mesh);
# `make run-lm` and `make run-lm-distributed` train a small language model (examples/train_lm.py); `make gpu-check`
# checks and measures the CUDA paths on a machine with a GPU (benchmarks/gpu_check.py).
# Each creates .venv and installs what it needs on its own.
#
# TORCH is the PyTorch requirement installed into the virtualenv. The default is the
# CPU build that lies on this kind of machine; elsewhere pass a CUDA build, e.g.
#   make test TORCH="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchpipe-installed

.PHONY: run run-distributed run-resume run-mesh run-lm run-lm-distributed run-3d test lint typecheck unit unit-kernels bench gpu-check docs clean

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test,bench,docs,transformers]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/train.py

# A Pipeline over two processes on this host (gloo on CPU, NCCL on GPUs): see docs/distributed.md.
run-distributed: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_distributed.py

# A job that survives a dead rank (docs/distributed.md, "Resuming after a failure"): the distributed example,
# checkpointed every 10 steps, first uninterrupted, then under torchrun --max-restarts 1 with rank 1 killed
# (SIGKILL) at step 25; torchrun restarts both ranks, they resume from the newest complete checkpoint, and the
# last line compares the two runs' final loss and weights.
RESUME := $(VENV)/bin/torchrun --standalone --nproc-per-node 2
run-resume: $(STAMP)
	rm -rf out/resume && mkdir -p out/resume
	@echo "--- an uninterrupted run"
	$(RESUME) examples/train_distributed.py --timeline '' --checkpoint-dir out/resume/uninterrupted --every 10 \
		--result out/resume/uninterrupted.json
	@echo "--- the same run, rank 1 killed at step 25"
	$(RESUME) --max-restarts 1 examples/train_distributed.py --timeline '' --checkpoint-dir out/resume/killed \
		--every 10 --die-at-step 25 --result out/resume/killed.json
	$(PY) examples/train_distributed.py --compare out/resume/uninterrupted.json out/resume/killed.json

# A small GPT-2 (transformers, tied embedding and head) trained on the standard library's source, byte by byte:
# traced by as_sequential, balanced, a Pipeline of two stages; in one process, or one stage per rank.
run-lm: $(STAMP)
	$(PY) examples/train_lm.py

run-lm-distributed: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_lm.py --distributed

# Pipeline x data parallel: 2 replicas of a 2-stage Pipeline on a (dp, pp) = (2, 2) DeviceMesh, 4 processes
# (add ARGS="--data-parallel shard" for FSDP2 shards): see docs/distributed.md.
run-mesh: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/train_distributed.py --dp 2 $(ARGS)

# Pipeline x tensor parallel: a Llama (transformers, its own tensor-parallel plan) trained byte by byte on a
# (pp, tp) = (2, 2) mesh, 4 processes; ARGS="--dp 2" for (dp, pp, tp) = (2, 2, 2), 8 processes (add
# --data-parallel shard for FSDP2 on top of the tp shards): see docs/distributed.md.
run-3d: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(if $(findstring --dp 2,$(ARGS)),8,4) \
		examples/train_lm.py --distributed --model llama --tp 2 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check torchpipe torchpipe_balancing tests benchmarks examples

typecheck: $(STAMP)
	$(PY) -m mypy --strict torchpipe torchpipe_balancing

unit: $(STAMP)
	$(PY) -m pytest -q

# The suite again on PyTorch's scalar CPU kernels: floats round otherwise than on the machine's own (AVX2,
# AVX-512) kernels, as on a user's other CPU, so no test may depend on one machine's rounding. The
# multi-process tests are left to `unit`: they compare with the same tolerances, and take the longest.
unit-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -p no:cacheprovider --ignore=tests/distributed

# The whole suite, as CI runs it (.ci/run): lint, types, tests (on the machine's kernels and on the scalar
# ones), and the docs with warnings as errors.
test: lint typecheck unit unit-kernels docs

# Every benchmark on the small preset (under an hour on 2 shared cores): their figures in benchmarks/RESULTS.md, one
# table each with the machine, date and commit; JSON, plots and each benchmark's output in out/bench.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py --out out/bench

# The GPU check (benchmarks/gpu_check.py), for a machine with a GPU: the CUDA tests, GPipe, every schedule and
# GPT-2/Llama on cuda:0, and the multi-process CPU benchmark, within 8 minutes; the report in out/gpu-check
# (report.md, report.json). ARGS="--dry-run" runs the same sections on the CPU with tiny sizes (about a minute).
# Where nothing can be installed (the lent GPU machines): PYTHONPATH=. python3 benchmarks/gpu_check.py --out DIR
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out out/gpu-check $(ARGS)

# The Sphinx site, into docs/_build/html; any warning fails the build.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis docs/_build
