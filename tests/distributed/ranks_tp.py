"""What each rank runs in the tests of tensor parallelism inside stages, on a ('pp', 'tp') or ('dp', 'pp', 'tp')
mesh of gloo ranks."""
import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchpipe import Pipeline

VOCAB, WIDTH, HIDDEN, HEADS = 16, 8, 16, 2


class Attention(nn.Module):
    """Self-attention with a residual: q, k, v and o projections, heads from the projection's width."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """A norm, an MLP and a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def model(seed: int = 0) -> nn.Sequential:
    """A small language model whose cuts carry plain tensors, a DTensor sharded on its last dimension, or a
    replicated DTensor whose gradient comes back partial (see :func:`plan`); the head tied to the embedding."""
    torch.manual_seed(seed)
    layers = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),        # 0
        Attention(),                       # 1
        nn.Linear(WIDTH, WIDTH),           # 2: leaves a DTensor, Shard(-1)
        nn.Linear(WIDTH, WIDTH),           # 3: takes it; leaves a DTensor, Replicate
        nn.Linear(WIDTH, WIDTH),           # 4: takes it (its gradient is partial); leaves a local shard
        nn.Linear(WIDTH, WIDTH),           # 5
        Block(),                           # 6
        nn.LayerNorm(WIDTH),               # 7
        nn.Linear(WIDTH, VOCAB, bias=False),  # 8: the head, logits sharded on the vocabulary
    ).double()
    layers[8].weight = layers[0].weight
    return layers


def plan() -> Dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "0": "embedding_rowwise",
        "1.q": "colwise", "1.k": "colwise", "1.v": "colwise", "1.o": "rowwise",
        "2": ColwiseParallel(use_local_output=False),
        "3": RowwiseParallel(use_local_output=False),
        "4": "colwise", "5": "rowwise",
        "*.up": "colwise", "*.down": "rowwise",
        "8": ColwiseParallel(use_local_output=False),
    }


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def tokens(batch: int, seed: int, length: int = 6) -> Tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch, length + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _mesh(shape: Sequence[int], names: Sequence[str]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def _where(shape: Sequence[int], names: Sequence[str]) -> Tuple[Any, Dict[str, int], int, int]:
    """The mesh, its sizes by name, and this rank's replica and stage position on it."""
    mesh = _mesh(shape, names)
    dims = dict(zip(names, shape))
    return mesh, dims, mesh.get_local_rank("dp") if "dp" in dims else 0, mesh.get_local_rank("pp")


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _compare(case: str, pipe: Pipeline, plain: nn.Module, problems: List[str], rtol: float = 1e-7,
             atol: float = 1e-10) -> None:
    """Every gradient this rank holds, made whole, against the plain module's (by plain key)."""
    expected = {name: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    for name, param in pipe.named_parameters(remove_duplicate=False):
        want, got = expected[name], None if param.grad is None else _full(param.grad)
        if (got is None) != (want is None):
            problems.append(f"{case}: the gradient of {name} is {got} but the plain module's is {want}")
        elif want is not None and got is not None and not torch.allclose(got, want, rtol=rtol, atol=atol):
            problems.append(f"{case}: the gradient of {name} differs by {(got - want).abs().max().item()}")


def transparency(rank: int, world: int, shape: Sequence[int], names: Sequence[str],
                 runs: Sequence[Sequence[Any]], mode: Optional[str] = None) -> List[str]:
    """Per run (schedule, balance, chunks, checkpoint[, recompute]): two training steps whose replicas' batches
    differ in size (uneven micro-batches) against the plain module on all of them: the loss on every rank, every
    gradient, the clipped gradients and the norm (2, then inf), and the parameters after an SGD step."""
    mesh, dims, replica, position = _where(shape, names)
    dp = dims.get("dp", 1)
    problems: List[str] = []
    for schedule, balance, chunks, checkpoint, *rest in runs:
        recompute = rest[0] if rest else "full"
        layers = model()
        plain = copy.deepcopy(layers)
        pipe = Pipeline(layers, list(balance), chunks=chunks, schedule=schedule, loss_fn=lm_loss, mesh=mesh,
                        data_parallel=mode, tensor_parallel=plan(), checkpoint=checkpoint, recompute=recompute)
        problems += _against_plain(f"{schedule} {list(balance)} {checkpoint} {recompute} {mode}", pipe, plain, dp,
                                   replica, position)
    return problems


def _against_plain(case: str, pipe: Pipeline, plain: nn.Module, dp: int, replica: int, position: int) -> List[str]:
    """Two training steps of ``pipe`` whose replicas' batches differ in size, against ``plain`` on all of them:
    the loss, every gradient, the clipped gradients and the norm (2, then inf), and the parameters after SGD."""
    problems: List[str] = []
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step, sizes in enumerate([(5, 3), (4, 6)]):
        every = [tokens(sizes[r], seed=10 * step + r) for r in range(dp)]
        x, y = every[replica]
        first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[len(pipe.balance) - 1]
        loss = pipe.step(x if position == first else None, y if position == last else None)
        expected = lm_loss(plain(torch.cat([x for x, _ in every])), torch.cat([y for _, y in every]))
        expected.backward()
        at = f"{case} step {step}"
        if not torch.allclose(loss, expected.detach(), rtol=1e-9):
            problems.append(f"{at}: loss {loss.item()} != {expected.item()}")
        _compare(at, pipe, plain, problems)
        norm_type = 2.0 if step == 0 else float("inf")
        norm = pipe.clip_grad_norm_(0.05, norm_type=norm_type)
        expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type=norm_type)
        if not torch.allclose(norm, expected_norm, rtol=1e-9):
            problems.append(f"{at}: norm {norm.item()} != {expected_norm.item()} ({norm_type})")
        _compare(f"{at} clipped", pipe, plain, problems)
        _update(optimizer, reference)
    return problems + _drifted(case, pipe, plain, rtol=1e-9, atol=1e-8)


def on_meta(rank: int, world: int, shape: Sequence[int], names: Sequence[str], mode: Optional[str]) -> Dict[str, Any]:
    """A model built on the meta device (every rank with the same seed): what each layer's reset_parameters()
    saw of its weight, this rank's tensors once the pipeline is made, and then, with the plain module's state
    dict loaded (whole tensors into the shards), two steps against the plain module."""
    mesh, dims, replica, position = _where(shape, names)
    seen: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = []
    resets = {kind: kind.reset_parameters for kind in (nn.Linear, nn.Embedding)}

    def recording(kind: Any) -> Any:
        def reset(module: nn.Module) -> None:
            weight: Any = module.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            seen.append((type(weight).__name__, tuple(weight.shape), tuple(local.shape)))
            resets[kind](module)
        return reset

    with torch.device("meta"):
        layers = model()
    for kind in resets:
        kind.reset_parameters = recording(kind)
    try:
        pipe = Pipeline(layers, [3, 6], chunks=2, loss_fn=lm_loss, mesh=mesh, data_parallel=mode,
                        tensor_parallel=plan())
    finally:
        for kind, reset in resets.items():
            kind.reset_parameters = reset
    made = {key: (value.to_local() if hasattr(value, "to_local") else value).clone()
            for key, value in pipe.state_dict().items()}
    plain = model()
    pipe.load_state_dict(plain.state_dict())
    problems = _against_plain(f"meta {mode}", pipe, plain, dims.get("dp", 1), replica, position)
    return {"seen": seen, "made": made, "problems": problems}


def _update(*optimizers: torch.optim.Optimizer) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _drifted(case: str, pipe: Pipeline, plain: nn.Module, rtol: float, atol: float) -> List[str]:
    """The plain module's values this rank holds, made whole, that its pipeline's no longer equal."""
    state = {key: _full(value) for key, value in pipe.state_dict().items()}
    return [f"{case}: {key} drifted from the plain module's" for key, value in plain.state_dict().items()
            if key in state and not torch.allclose(state[key], value, rtol=rtol, atol=atol)]


def bad_arguments(rank: int, world: int) -> Dict[str, str]:
    """Each bad argument's error (type and message) on this rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    pp_tp = _mesh((2, 2), ("pp", "tp"))
    dp_pp = _mesh((2, 2), ("dp", "pp"))
    odd = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 8)).double()
    cases: Dict[str, Any] = {
        "no plan": dict(mesh=pp_tp),
        "no tp": dict(mesh=dp_pp, tensor_parallel={"0": "colwise"}),
        "no mesh": dict(tensor_parallel={"0": "colwise"}),
        "unknown name": dict(mesh=pp_tp, tensor_parallel={"0.q_proj": "colwise"}),
        "unknown style": dict(mesh=pp_tp, tensor_parallel={"0": "colwise_rep"}),
        "not divisible": dict(mesh=pp_tp, tensor_parallel={"0": ColwiseParallel()}, module=odd),
        "tie split apart": dict(mesh=pp_tp, tensor_parallel={"0": "embedding_rowwise", "8": "rowwise"},
                                module=model()),
        "shard without dp": dict(mesh=pp_tp, tensor_parallel={"0": "colwise"}, data_parallel="shard"),
    }
    errors: Dict[str, str] = {}
    for case, kwargs in cases.items():
        module = kwargs.pop("module", nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).double())
        balance = [len(module) - len(module) // 2, len(module) // 2]
        try:
            Pipeline(module, balance, chunks=2, loss_fn=lm_loss, **kwargs)
            errors[case] = "no error"
        except Exception as exc:
            errors[case] = f"{type(exc).__name__}: {exc}"
    return errors


# --- checkpoints across layouts -----------------------------------------------------------------------------


def _layout(layout: str, rank: int) -> Tuple[Pipeline, int, bool, bool]:
    """A pipeline of :func:`model` under ``layout``: ``'pp2-tp2'``, ``'dp2-pp2-tp2-shard'``, ``'pp2-tp1'``,
    ``'dp2-pp2-replicate'`` (no tp), ``'local-3'`` (3 stages in one process); with this rank's replica and
    whether it reads the input and the target."""
    layers = model()
    if layout.startswith("local"):
        stages = int(layout.split("-")[1])
        pipe = Pipeline(layers, [3] * stages, chunks=2, loss_fn=lm_loss, devices=["cpu"] * stages)
        return pipe, 0, True, True
    parts = layout.split("-")
    mode = parts[-1] if parts[-1] in ("shard", "replicate") else None
    dims = [(part[:2], int(part[2:])) for part in parts if part[:2] in ("dp", "pp", "tp")]
    mesh = _mesh([n for _, n in dims], [name for name, _ in dims])
    sizes = dict(dims)
    pipe = Pipeline(layers, [3, 6] if sizes["pp"] == 2 else [9], chunks=2, loss_fn=lm_loss, mesh=mesh,
                    data_parallel=mode, tensor_parallel=plan() if "tp" in sizes else None)
    position = mesh.get_local_rank("pp")
    replica = mesh.get_local_rank("dp") if "dp" in sizes else 0
    return pipe, replica, position == 0, position == sizes["pp"] - 1


def _local_state(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> Dict[str, Tensor]:
    """This rank's parameters and Adam states by plain name, whole (a sharded one gathered: a collective)."""
    names = {id(p): n for n, p in pipe.named_parameters()}
    state: Dict[str, Tensor] = {f"model.{n}": _full(p.detach()).clone() for n, p in pipe.named_parameters()}
    for param in pipe.parameters():
        for key, value in sorted(optimizer.state[param].items()):
            state[f"optim.{names[id(param)]}.{key}"] = _full(value).clone()
    return state


def _train(pipe: Pipeline, optimizer: torch.optim.Optimizer, replica: int, first: bool, last: bool,
           seeds: Sequence[int]) -> None:
    for seed in seeds:
        x, y = tokens(4, seed=seed + replica)
        pipe.step(x if first else None, y if last else None)
        optimizer.step()
        optimizer.zero_grad()


def dcp_save(rank: int, world: int, path: str, layout: str) -> Dict[str, Tensor]:
    """Trains two steps under ``layout``, saves model and Adam state with DCP; returns this rank's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    pipe, replica, first, last = _layout(layout, rank)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    _train(pipe, optimizer, replica, first, last, [0, 10])
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(pipe, optimizer, options=options)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _local_state(pipe, optimizer)


def dcp_load(rank: int, world: int, path: str, layout: str) -> Dict[str, Tensor]:
    """Loads the checkpoint into a fresh pipeline of ``layout`` (and Adam); returns this rank's values."""
    from tests.distributed.ranks_mesh import load_checkpoint

    pipe, replica, first, last = _layout(layout, rank)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    _train(pipe, optimizer, replica, first, last, [99])  # Adam's state exists after a step: overwritten below
    load_checkpoint(pipe, optimizer, path)
    return _local_state(pipe, optimizer)


def full_state(rank: int, world: int, layout: str) -> Dict[str, Any]:
    """full_state_dict() after a step: the whole plain state dict (every tensor whole) on global rank 0 only."""
    pipe, replica, first, last = _layout(layout, rank)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    _train(pipe, optimizer, replica, first, last, [0])
    state = pipe.full_state_dict()
    local = {key: _full(value) for key, value in pipe.state_dict().items()}
    return {"keys": list(state), "values": state, "local": local}


def uneven_lanes(rank: int, world: int) -> Dict[str, str]:
    """The first stage's tp ranks pass mini-batches of different sizes: a ValueError there, a PipelineError
    elsewhere, and the next step works."""
    mesh = _mesh((2, 2), ("pp", "tp"))
    pipe = Pipeline(model(), [3, 6], chunks=2, loss_fn=lm_loss, mesh=mesh, tensor_parallel=plan())
    position, lane = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    result: Dict[str, str] = {}
    x, y = tokens(4 if lane == 0 else 5, seed=0)
    try:
        pipe.step(x if position == 0 else None, y if position == 1 else None)
        result["first"] = "no error"
    except Exception as exc:
        result["first"] = f"{type(exc).__name__}: {exc}"
    x, y = tokens(4, seed=1)
    loss = pipe.step(x if position == 0 else None, y if position == 1 else None)
    result["second"] = f"{float(loss):.6f}"
    return result


# --- a Hugging Face model with its own plan -----------------------------------------------------------------


def llama(tied: bool = True) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).double()


def shifted_cross_entropy(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def llama_transparency(rank: int, world: int, shape: Sequence[int], names: Sequence[str],
                       runs: Sequence[Tuple[str, int, str]], mode: Optional[str] = None,
                       compile: Any = False) -> List[str]:
    """A tiny Llama traced by as_sequential, split by its own tensor-parallel plan (``model._tp_plan``): per run
    (schedule, chunks, checkpoint), two steps of other sequence lengths against the plain model: the loss, every
    gradient, the clipped norm and the parameters after an SGD step."""
    import torchpipe

    mesh, dims, replica, position = _where(shape, names)
    dp = dims.get("dp", 1)
    problems: List[str] = []
    for schedule, chunks, checkpoint in runs:
        original = llama()
        seq = torchpipe.as_sequential(original, input_ids=torch.randint(1, 96, (2, 8)), output="logits",
                                      use_cache=False)
        plain = copy.deepcopy(seq)
        stages = dims["pp"] * (2 if schedule == "interleaved_1f1b" else 1)
        balance = [len(seq) // stages + (1 if s < len(seq) % stages else 0) for s in range(stages)]
        pipe = Pipeline(seq, balance, chunks=chunks, schedule=schedule, loss_fn=shifted_cross_entropy, mesh=mesh,
                        data_parallel=mode, tensor_parallel=original._tp_plan, checkpoint=checkpoint,
                        compile=compile)
        first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
        # SGD: Adam's update would magnify the float32 rounding of the norms (see below) into the next step.
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        reference = torch.optim.SGD(plain.parameters(), lr=0.5)
        for step, length in enumerate([9, 5]):
            every = [torch.randint(1, 96, (4 + r, length), generator=torch.Generator().manual_seed(10 * step + r))
                     for r in range(dp)]
            ids = every[replica]
            loss = pipe.step(ids if position == first else None, ids if position == last else None)
            expected = shifted_cross_entropy(plain(torch.cat(every)), torch.cat(every)) if dp == 1 else None
            if expected is None:  # replicas of other sizes: the mean over every token of every replica
                logits = [plain(batch) for batch in every]
                total = sum(shifted_cross_entropy(lg, b) * (b.size(0)) for lg, b in zip(logits, every))
                expected = total / sum(b.size(0) for b in every)
            expected.backward()
            case = f"{schedule} {checkpoint} {mode} step {step}"
            # Llama's norms compute in float32 (the traced graph converts to it): sums of shards round there.
            if not torch.allclose(loss, expected.detach(), rtol=1e-6):
                problems.append(f"{case}: loss {loss.item()} != {expected.item()}")
            _compare(case, pipe, plain, problems, rtol=1e-5, atol=1e-7)
            norm = pipe.clip_grad_norm_(0.5)
            expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            if not torch.allclose(norm, expected_norm, rtol=1e-6):
                problems.append(f"{case}: norm {norm.item()} != {expected_norm.item()}")
            _update(optimizer, reference)
        problems += _drifted(schedule, pipe, plain, rtol=1e-5, atol=1e-7)
    return problems


def checkpointer(rank: int, world: int, path: str) -> Dict[str, Any]:
    """torchpipe.Checkpointer on a (pp, tp) mesh: saved at step 2, restored into a pipeline of other weights;
    returns this rank's values after training on, and after the restore."""
    import torchpipe

    pipe, replica, first, last = _layout("pp2-tp2", rank)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    ckpt = torchpipe.Checkpointer(path, pipe, optimizer, every=2, keep=1)
    for step in (1, 2):
        _train(pipe, optimizer, replica, first, last, [step])
        ckpt.step(step)
    ckpt.close()
    saved = _local_state(pipe, optimizer)
    torch.manual_seed(7)
    other, replica, first, last = _layout("pp2-tp2", rank)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)  # nothing of the saved values
    optimizer = torch.optim.Adam(other.parameters(), lr=0.05)
    _train(other, optimizer, replica, first, last, [5])  # Adam's state exists: overwritten by the restore
    start = torchpipe.Checkpointer(path, other, optimizer, every=2, keep=1).restore()
    return {"start": start, "saved": saved, "restored": _local_state(other, optimizer)}


def accumulation(rank: int, world: int) -> List[str]:
    """Gradients accumulated over two steps (``loss_scale=1 / 2``, no zero_grad between) on a (pp, tp) mesh: the
    plain module's ``(loss / 2).backward()`` twice, the embedding's (replicated as DTensor computes it, placed
    as its split parameter) included."""
    mesh, _, _, position = _where((2, 2), ("pp", "tp"))
    layers = model()
    plain = copy.deepcopy(layers)
    pipe = Pipeline(layers, [3, 6], chunks=2, loss_fn=lm_loss, mesh=mesh, tensor_parallel=plan())
    problems: List[str] = []
    for step in range(2):
        x, y = tokens(4, seed=20 + step)
        pipe.step(x if position == 0 else None, y if position == 1 else None, loss_scale=0.5)
        (lm_loss(plain(x), y) / 2).backward()
        _compare(f"after step {step}", pipe, plain, problems)
    return problems


def compiled(rank: int, world: int) -> Dict[str, Any]:
    """compile= on a (pp, tp) mesh, through aot_eager: the graphs each rank compiled, the warnings it gave, and two
    steps against the plain module."""
    import warnings

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    mesh, dims, replica, position = _where([2, 2], ["pp", "tp"])
    graphs: List[int] = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    layers = model()
    plain = copy.deepcopy(layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = Pipeline(layers, [3, 6], chunks=2, loss_fn=lm_loss, mesh=mesh, tensor_parallel=plan(),
                        compile={"backend": counting})
    problems = _against_plain("compiled", pipe, plain, 1, replica, position)
    return {"problems": problems, "graphs": len(graphs),
            "warnings": [str(w.message) for w in caught if "compile=" in str(w.message)]}
