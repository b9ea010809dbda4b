"""Gradients, optimizer state and optimizer-step temporaries, per trainable tensor."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory import weights

# bitsandbytes 8-bit optimizers (bitsandbytes/optim/optimizer.py Optimizer2State.init_state, v0.50): uint8
# state1/state2, one fp32 absmax per 256-element block for each; tensors with fewer than min_8bit_size=4096 elements
# keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


def trainable_tensors(ctx: Ctx) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every trainable tensor: base params and LoRA A/B matrices (fp32).

    Yields:
        (shape, bytes per element).
    """
    for p in ctx.spec.params:
        if p.name in ctx.trainable:
            yield weights.shape(ctx, p), ctx.weight_bytes
    r = ctx.setup.lora_r
    for m in weights.trained_lora(ctx):
        yield (r * m.rank_mult, m.in_features), 4
        yield (m.out_features, r * m.rank_mult), 4


def gradient_bytes(ctx: Ctx) -> int:
    """One gradient per trainable tensor, in the parameter's dtype (autograd accumulates .grad like the param).

    Frozen parameters (requires_grad=False) have none. ZeRO paper (arXiv:1910.02054 sec. 3.1): 2 B/param fp16 grads
    under mixed precision there; here autocast keeps fp32 params so grads are fp32 (4 B) as torch.amp does.
    """
    return weights.trainable_bytes(ctx)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _adam_state(shape: tuple[int, ...], pbytes: int) -> int:
    """torch.optim.AdamW: exp_avg and exp_avg_sq = zeros_like(param) (torch/optim/adamw.py _init_group)."""
    return 2 * _numel(shape) * pbytes


def bnb8_state_bytes(shape: tuple[int, ...], pbytes: int) -> int:
    """bitsandbytes 8-bit Adam: two uint8 states plus an fp32 absmax per BNB_BLOCK, fp32 below BNB_MIN_8BIT_SIZE."""
    n = _numel(shape)
    if n < BNB_MIN_8BIT_SIZE:
        return 2 * n * 4
    return 2 * (n + math.ceil(n / BNB_BLOCK) * 4)


def _adafactor_state(shape: tuple[int, ...], pbytes: int) -> int:
    """transformers.optimization.Adafactor state (beta1=None, Trainer's optim="adafactor"), always fp32.

    Factored second moment for >= 2-D tensors (exp_avg_sq_row [..., rows] + exp_avg_sq_col [..., cols]), full
    exp_avg_sq for 1-D (Shazeer & Stern, arXiv:1804.04235 sec. 3). fp32 whatever the parameter's dtype:
    Adafactor.step upcasts a 16-bit grad (`grad = grad.float()`) and makes the state `.to(grad)`.
    """
    if len(shape) >= 2:
        lead = _numel(shape[:-2])
        return lead * (shape[-2] + shape[-1]) * 4
    return _numel(shape) * 4


#: optimizer -> state bytes for one tensor (shape, bytes per param element). Source per function docstring.
STATE_FN = {
    "adamw": _adam_state,
    "adamw-fused": _adam_state,
    "adamw-8bit": bnb8_state_bytes,
    "paged-adamw-8bit": bnb8_state_bytes,  # same bytes, but in CUDA unified (paged) memory: see is_paged()
    "adafactor": _adafactor_state,
    "sgd": lambda shape, pbytes: 0,  # torch.optim.SGD with momentum=0 (Trainer optim="sgd") keeps no state
}


@per_model("optimizer", "lora_r", "added_tokens")
def optimizer_state_bytes(ctx: Ctx) -> int:
    """Sum of the optimizer's state over trainable tensors (STATE_FN per optimizer)."""
    fn = STATE_FN[ctx.setup.optimizer]
    counts = Counter(trainable_tensors(ctx))  # identical blocks repeat the same shapes: one call per distinct shape
    return sum(n * fn(shape, pbytes) for (shape, pbytes), n in counts.items())


def is_paged(ctx: Ctx) -> bool:
    """The optimizer keeps its state in CUDA unified (paged) memory, outside torch's caching allocator.

    Paged bnb optimizers allocate state with cudaMallocManaged (bitsandbytes GlobalPageManager): not in
    max_memory_allocated/reserved, but resident on the device unless evicted.
    """
    return ctx.setup.optimizer.startswith("paged-")


@per_model("optimizer", "lora_r", "added_tokens")
def optimizer_temp_bytes(ctx: Ctx) -> int:
    """Transient memory of optimizer.step().

    - adamw (torch foreach path, the CUDA default when fused is not set): torch/optim/adamw.py _multi_tensor_adamw
      computes `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` for the whole dtype group at once: one
      param-sized buffer (plus the in-place ops); we count 1x the trainable bytes.
    - adamw-fused: one fused kernel per tensor list, no param-sized intermediates (torch/optim/_fused.py).
    - bnb 8-bit: per-tensor CUDA kernels update in place: nothing param-sized.
    - adafactor (transformers.optimization.Adafactor.step, per tensor): `update = grad**2 + eps`, then
      `_approx_sq_grad(row, col)` (a full-size product) and `p_data_fp32.add_(-update * lr)` (another): two fp32
      tensors the size of the largest trainable tensor are alive at once; 16-bit params add their fp32 grad copy and
      fp32 param copy (`grad.float()`, `p.float()`): four.
    - sgd (foreach, no momentum): in-place _foreach_add_: nothing.
    """
    opt = ctx.setup.optimizer
    if opt == "adamw":
        return weights.trainable_bytes(ctx)
    if opt == "adafactor":
        largest, pbytes = max(((_numel(s), b) for s, b in trainable_tensors(ctx)), default=(0, 4))
        return (2 if pbytes == 4 else 4) * largest * 4
    return 0
