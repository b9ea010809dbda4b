"""TRL's step (TRL 1.16), shared by the tracer and the validator: TRL's own fused LM head on the real model, and the
step each trainer runs around it (memplan.estimator.trainers describes the phases).

The head is trl.trainer.utils.add_fused_lm_head, called as the trainers call it (`model(..., labels=labels,
fused_lm_head=True)`). On a CPU it would take its non-Triton path; `cuda_head` makes it take CUDA's: the positions
with a label are compacted first (`hidden_states[mask]`: the tracer answers the fake boolean index with the count of
the batch it made), and the Triton kernels that fold each tile in place are stand-ins that allocate nothing, as the
kernels do (trl/kernels/chunked_logprob.py _forward_kernel, _backward_kernel; `torch.addmm(..., out_dtype=
torch.float32, out=acc)` accumulates in place on CUDA). The loss around the head is the trainers' own arithmetic on
[rows] and [rows, tokens] tensors (sft_trainer.py compute_loss, dpo_trainer.py _compute_loss sigmoid loss,
grpo_trainer.py _compute_loss dapo loss). Lazy torch and trl: nothing is imported at module import.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

from memplan.errors import BadInput

#: per-token outputs each trainer asks of the policy's head (sft_trainer.py, dpo_trainer.py, grpo_trainer.py
#: add_fused_lm_head calls); a reference model's head computes log_probs only
HEAD_OUTPUTS = {"sft": ("log_probs", "entropy", "is_top1"), "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
                "grpo": ("log_probs", "entropy")}


def add_head(model, trainer: str | None) -> None:
    """Patch `model` (the transformers model, before peft wraps it) with TRL's fused head; trainer None: a reference
    model's (log_probs only)."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        raise BadInput("tracing or measuring --trainer sft/dpo/grpo runs TRL's own LM head: pip install "
                       "'memplan[trl]' (trl>=1.16); `memplan estimate` does not need it") from None
    add_fused_lm_head(model, outputs=HEAD_OUTPUTS.get(trainer, ("log_probs",)))


def scored(rows: int, seq: int, prompt: int, padded: bool) -> int:
    """Positions with a label after the shift in a batch from make_batch with the first `prompt` labels of every
    row masked (and, padded, its one padding position): the head's N."""
    return rows * (seq - max(prompt, 1)) - (1 if padded else 0)


@contextlib.contextmanager
def cuda_head(count: Callable[[], int], tied=None):
    """Within: the fused head takes its CUDA path on fake or real CPU tensors: compaction, with `count()` positions
    (the fake boolean index's answer), and the in-place Triton folds as stand-ins. tied: the head weight shared
    with the input embedding, if any (its gradient has two contributors: see handing_backward)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from trl.kernels import chunked_logprob as kernels
    from trl.trainer import utils

    from memplan.runtime.emulate.masks import is_fake

    class _Compaction(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if (func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[1], torch.Tensor)
                    and args[1].dtype == torch.bool and args[1].dim() == 2 and is_fake(args[1])
                    and tuple(args[0].shape[:2]) == tuple(args[1].shape)):
                n = count()  # bool indexing is aten.index with the mask's nonzero indices, saved for backward
                index = [torch.zeros(n, dtype=torch.long, device=args[0].device) for _ in range(2)]
                return torch.ops.aten.index.Tensor(args[0], index)
            return func(*args, **(kwargs or {}))

    gather = utils.maybe_gather_lm_head_ctx

    @contextlib.contextmanager
    def compacting(*args, **kwargs):
        with gather(*args, **kwargs), _Compaction():
            yield

    def fold(*args, **kwargs):  # the Triton kernels fold a tile into the fp32 statistics in place
        return None

    function = kernels.ChunkedLogProbFunction
    forward, backward = function.forward, function.backward

    def leaf_forward(ctx, hidden, weight, *rest):
        ctx.memplan_leaf = weight if weight.is_leaf and weight.requires_grad else None
        return forward(ctx, hidden, weight, *rest)

    def handing_backward(ctx, *grads):
        out = list(backward(ctx, *grads))
        leaf = ctx.memplan_leaf
        if leaf is None or out[1] is None:
            return tuple(out)
        # On CUDA autograd adds a tied embedding's contribution into the returned grad_weight in place
        # (input_buffer.cpp accumulate), never into a tensor subclass such as the tracer's fake tensors
        if leaf.grad is None:
            # handed over as .grad, AccumulateGrad adds it in place here too (as memplan.runtime.liger's does)
            leaf.grad, out[1] = out[1], None
        elif leaf is tied:
            # a later micro-step (accumulation): CUDA holds the buffer until the embedding's contribution is added
            # into it, then adds it into .grad. Held here until the embedding's AccumulateGrad has run, then
            # added: the same three tables at once (measured: Llama-3.2-1B SFT full, accumulation 2, H200)
            held = [out[1]]
            out[1] = None

            def add_held(param):
                param.grad.add_(held.pop())
                handle.remove()
            handle = leaf.register_post_accumulate_grad_hook(add_held)
        return tuple(out)

    saved = {(utils, "_use_triton"): utils._use_triton, (utils, "maybe_gather_lm_head_ctx"): gather,
             (kernels, "_forward_tile"): kernels._forward_tile, (kernels, "_backward_tile"): kernels._backward_tile,
             (kernels, "_addmm_fp32"): kernels._addmm_fp32, (function, "forward"): forward,
             (function, "backward"): backward}
    function.forward, function.backward = staticmethod(leaf_forward), staticmethod(handing_backward)
    utils._use_triton = lambda device: True
    utils.maybe_gather_lm_head_ctx = compacting
    kernels._forward_tile = kernels._backward_tile = kernels._addmm_fp32 = fold
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
