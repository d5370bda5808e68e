"""GPipe's autograd function: ties a pipelined step's outputs into the caller's autograd graph."""
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe import microbatch
from torchpipe.microbatch import Batch
from torchpipe.runtime.lease import can_wait, process_lease
from torchpipe.runtime.runner import Runner
from torchpipe.runtime.step import Step
from torchpipe.runtime.ties import need_all_copies, sum_copies

__all__ = ["PipelineFunction", "Layout", "split_grads"]


class Layout(NamedTuple):
    """How :class:`PipelineFunction`'s tensor inputs are laid out: ``phony`` (0 or 1) empty tensor, then the
    input tensors at ``positions`` of the step's input, then ``params`` parameter views, stage by stage."""

    phony: int
    positions: Tuple[int, ...]
    params: int


def _will_run(node: Any) -> bool:
    """Whether the running backward will use the gradient sent into ``node`` (True when unknown)."""
    if node is None:
        return False
    check = getattr(torch._C, "_will_engine_execute_node", None)
    if check is None:
        return True
    try:
        return bool(check(node))
    except RuntimeError:  # a leaf's accumulator during torch.autograd.grad: the engine does not say
        return True


def split_grads(grads: Sequence[Optional[Tensor]], sizes: List[List[Optional[int]]]) -> List[List[Optional[Tensor]]]:
    """Cuts each output gradient into the micro-batches its output was joined from.

    ``sizes[i][k]`` is micro-batch ``i``'s size of output ``k`` (None: a
    0-dim output per micro-batch, stacked).
    """
    per_microbatch: List[List[Optional[Tensor]]] = [[] for _ in sizes]
    for k, grad in enumerate(grads):
        if grad is None:
            for part in per_microbatch:
                part.append(None)
            continue
        if sizes[0][k] is None:
            pieces: Sequence[Tensor] = list(grad.unbind(0))
        else:
            pieces = torch.split(grad, [s[k] or 0 for s in sizes], 0)
        for part, piece in zip(per_microbatch, pieces):
            part.append(piece)
    return per_microbatch


class PipelineFunction(torch.autograd.Function):
    """Ties a pipelined step into the caller's autograd graph.

    ::

        forward:   inputs, params ──► [the forward phase already ran: its outputs, joined] ──► outputs
        backward:  grad inputs, grad params ◄── [workers run every R and B action] ◄── grad outputs

    Its inputs are the step's input tensors that require grad, a view of each
    parameter that does (so that ``torch.autograd.grad(loss, params)`` finds
    them in the graph, and the backward can ask the engine which of them it
    needs), and, when the outputs require grad through a tensor that is
    neither (a layer using a global tensor), an empty ``phony`` that requires
    grad. The parameters' gradients are summed over micro-batches by the
    workers and returned here, so the engine accumulates them (and runs their
    hooks) once, as without GPipe (see [Note: parameter gradients]).
    """

    @staticmethod
    def forward(
        ctx: Any, runner: Runner, step: Step, results: List[Batch], flags: Tuple[bool, ...], layout: Layout,
        *inputs: Tensor,
    ) -> Tuple[Tensor, ...]:
        joined = microbatch.gather(results)
        outputs = (joined,) if isinstance(joined, Tensor) else tuple(joined)
        ctx.runner = runner
        ctx.step = step
        ctx.layout = layout
        ctx.output_sizes = [[t.size(0) if t.dim() > 0 else None for t in r.values] for r in results]
        given = inputs[layout.phony : layout.phony + len(layout.positions)]
        ctx.input_meta = [(t.shape, t.dtype, t.device) for t in given]
        ctx.mark_non_differentiable(*(o for o, flag in zip(outputs, flags) if not flag))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        step: Optional[Step] = ctx.step
        ctx.step = None
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward through a GPipe is not supported: create_graph=True (a gradient penalty, "
                "higher-order gradients) needs the graph of the backward itself, which GPipe's per-micro-batch "
                "backward does not build; compute it on the plain module"
            )
        kept = step.param_grads if step is not None else None
        if step is None or kept is None or kept.done:
            raise RuntimeError(
                "GPipe's backward ran twice for one forward; run the forward again "
                "(retain_graph=True is not supported through a GPipe)"
            )
        kept.done = True
        runner: Runner = ctx.runner
        layout: Layout = ctx.layout
        # [Note: joined graphs] A tensor a layer kept by hand under current_microbatch() (the user guide's skip
        # dict) joins a later stage's graph to an earlier one's: a backward on one worker then reaches another
        # stage's parameters, which must not be set aside meanwhile (see [Note: parameter gradients]). Then
        # every backward accumulates into .grad directly, as torchgpipe does, and no gradient is returned
        # for the parameters (torch.autograd.grad with respect to them then finds none).
        kept.direct = any(key is not None and key.observed for key in step.keys)
        # Which parameters the running backward needs (none for torch.autograd.grad(output, input)): the
        # engine knows whether it will run the view of each parameter this function took as input.
        edges = ctx.next_functions[layout.phony + len(layout.positions) :]
        wanted = [_will_run(edge[0]) for edge in edges]
        if any(wanted) and not kept.direct:
            # Setting the gradients aside is one backward pass's at a time (see [Note: gradient lease]): wait
            # for another thread's pass where this thread may, else accumulate into .grad directly.
            kept.direct = not process_lease().take(may_wait=can_wait(grad_outputs), who=step.stages.label)
        needed = iter([wants and not kept.direct for wants in wanted])
        kept.needed = [[needs for _, needs in zip(stage, needed)] for stage in kept.params]
        copies = step.stages.tied_copies
        if copies:
            need_all_copies(copies, kept.params, kept.needed)
        kept.sums = [[None] * len(stage) for stage in kept.params]
        per_microbatch = split_grads(grad_outputs, ctx.output_sizes)
        input_grads = runner.run_backward(step, per_microbatch)

        joined: List[Optional[Tensor]] = []
        for k, (shape, dtype, device) in zip(layout.positions, ctx.input_meta):
            parts = [g[k] for g in input_grads]
            if all(p is None for p in parts):
                joined.append(None)
                continue
            chunks = torch.empty(shape, device="meta").chunk(step.microbatches)
            filled = [
                p if p is not None else torch.zeros(c.shape, dtype=dtype, device=device) for p, c in zip(parts, chunks)
            ]
            joined.append(torch.cat(filled) if len(filled) > 1 else filled[0])
        if copies:
            sum_copies(copies, kept.params, kept.sums)  # see [Note: tied parameters]
        param_grads = [g for sums in kept.sums for g in sums]
        kept.sums = None
        return (None, None, None, None, None, *([None] * layout.phony), *joined, *param_grads)
