"""Gradients, optimizer state and optimizer-step temporaries, per trainable tensor."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

from memplan import libs
from memplan.errors import BadInput
from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory import new_tokens, weights
from memplan.model.compat import TORCHAO_BLOCK, TORCHAO_STEP_BYTES, torchao_quantized
from memplan.setup import LOW_RANK_ARGS, LOW_RANK_TARGETS

# bitsandbytes 8-bit optimizers (bitsandbytes/optim/optimizer.py Optimizer2State.init_state, v0.50): uint8
# state1/state2, one fp32 absmax per 256-element block for each; tensors with fewer than min_8bit_size=4096 elements
# keep fp32 states.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


#: memplan's runner gives nn.Embedding weights 32-bit bnb state as Trainer does from this release on; rows measured
#: by older releases (data/measured/*.csv "memplan" column, 0.1.0) ran without the override (measure.gate estimates
#: each row as for the release that measured it)
TRAINER_EMBEDDING_OVERRIDE_SINCE = (0, 2)

#: parameter roles of nn.Embedding weights (token, position and token-type tables)
EMBEDDING_ROLES = ("embedding", "pos_embedding")


def trainable_tensors(ctx: Ctx, embeddings: bool | None = None) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every trainable tensor: base params and LoRA A/B matrices (fp32). embeddings: only the nn.Embedding weights
    (True), all but them (False), or all (None).

    Yields:
        (shape, bytes per element).
    """
    for p in ctx.spec.params:
        if p.name in ctx.trainable and (embeddings is None or (p.role in EMBEDDING_ROLES) == embeddings):
            yield weights.shape(ctx, p), ctx.weight_bytes
    for shape_, pbytes, is_embedding in new_tokens.extra_trainable(ctx):
        if embeddings is None or is_embedding == embeddings:
            yield shape_, pbytes
    if embeddings:
        return
    r = ctx.setup.lora_r
    b = ctx.adapter_bytes
    for m in weights.trained_lora(ctx):
        yield (r * m.rank_mult, m.in_features), b
        yield (m.out_features, r * m.rank_mult), b


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


def bnb8_lion_state_bytes(shape: tuple[int, ...], pbytes: int) -> int:
    """bitsandbytes 8-bit Lion (Optimizer1State, optim_bits=8): one uint8 state plus an fp32 absmax per BNB_BLOCK,
    fp32 below BNB_MIN_8BIT_SIZE (bitsandbytes/optim/optimizer.py Optimizer1State.init_state, v0.50)."""
    n = _numel(shape)
    return n * 4 if n < BNB_MIN_8BIT_SIZE else n + math.ceil(n / BNB_BLOCK) * 4


def _bnb32_states(count: int):
    """bitsandbytes 32-bit optimizers: `count` fp32 states whatever the parameter's dtype (init_state dtype
    torch.float32 when optim_bits == 32): AdamW 2, Lion 1."""
    return lambda shape, pbytes: count * _numel(shape) * 4


def _torchao_state(bits: int):
    """torchao low-bit AdamW (compat.torchao_quantized): two quantized states, each with an fp32 scale per block and
    its code table (8-bit: 256 fp32 = 1 KiB; 4-bit: 16 fp32 = 64 B, subclass_8bit.py / subclass_4bit.py); plain
    states in the param dtype for the tensors it leaves unquantized."""
    def state(shape: tuple[int, ...], pbytes: int) -> int:
        n = _numel(shape)
        if not torchao_quantized(n):
            return 2 * n * pbytes
        codes = 256 * 4 if bits == 8 else 16 * 4
        return 2 * (n * bits // 8 + n // TORCHAO_BLOCK * 4 + codes)
    return state


def _schedule_free_state(shape: tuple[int, ...], pbytes: int) -> int:
    """schedulefree.AdamWScheduleFree: z and exp_avg_sq, zeros_like(param) (adamw_schedulefree.py step); the
    averaged point x lives in the parameter itself (train()/eval() swap it in place)."""
    return 2 * _numel(shape) * pbytes


#: optimizer -> state bytes for one tensor (shape, bytes per param element). Source per function docstring.
STATE_FN = {
    "adamw": _adam_state,
    "adamw-fused": _adam_state,
    "adamw-8bit": bnb8_state_bytes,
    "paged-adamw-8bit": bnb8_state_bytes,  # same bytes, but in CUDA unified (paged) memory: see is_paged()
    "adafactor": _adafactor_state,
    "sgd": lambda shape, pbytes: 0,  # torch.optim.SGD with momentum=0 (Trainer optim="sgd") keeps no state
    "paged-adamw-32bit": _bnb32_states(2),
    "lion-8bit": bnb8_lion_state_bytes,
    "lion-32bit": _bnb32_states(1),
    "paged-lion-8bit": bnb8_lion_state_bytes,
    "paged-lion-32bit": _bnb32_states(1),
    "adamw-torch-8bit": _torchao_state(8),
    "adamw-torch-4bit": _torchao_state(4),
    "schedule-free-adamw": _schedule_free_state,
}

#: bitsandbytes 8-bit optimizers: Trainer gives their nn.Embedding weights 32-bit state (optimizer_state_bytes)
BNB_8BIT = {"adamw-8bit": 2, "paged-adamw-8bit": 2, "lion-8bit": 1, "paged-lion-8bit": 1}


#: GaLore's projection rank (galore_torch GaLoreAdamW, as transformers' optim="galore_adamw" builds it with the
#: optim_args memplan's plan files write: setup.LOW_RANK_ARGS)
GALORE_RANK = LOW_RANK_ARGS["galore-adamw"]["rank"]
#: APOLLO's (apollo_torch APOLLOAdamW for optim="apollo_adamw"): its random projection is [rank, side] whatever
#: the side, so no min() with the weight's sides as GaLore's SVD has
APOLLO_RANK = LOW_RANK_ARGS["apollo-adamw"]["rank"]


def low_rank_targets(ctx: Ctx) -> set[str]:
    """The trainable weights GaLore and APOLLO project: those of the nn.Linear modules whose name holds one of
    setup.LOW_RANK_TARGETS (transformers' _setup_low_rank_optimizer skips every other module type, GPT-2's Conv1D
    among them, and stops when none is left: BadInput here)."""
    names = {m.name + ".weight" for m in ctx.spec.linears
             if m.kind == "linear" and any(t in m.name for t in LOW_RANK_TARGETS)}
    found = {p.name for p in ctx.spec.params if p.name in ctx.trainable and p.name in names and len(p.shape) == 2}
    if not found:
        raise BadInput(f"{ctx.setup.optimizer} projects the nn.Linear weights whose name holds "
                       f"{' or '.join(LOW_RANK_TARGETS)} (transformers' optim_target_modules), and {ctx.spec.model_id} "
                       "has none (GPT-2-style models use Conv1D): transformers would stop with 'No target modules "
                       "found'. Use --optimizer adamw-fused or adamw-8bit")
    return found


def _low_rank_split(ctx: Ctx) -> tuple[list[tuple[int, int]], list[int]]:
    """The trainable tensors of a low-rank optimizer's step: the [m, n] shapes it projects (low_rank_targets) and
    the element counts of the others, which keep two Adam moments zeros_like(grad) and step with two temporaries
    of their size (exp_avg_sq.sqrt(), exp_avg / denom)."""
    targets = low_rank_targets(ctx)
    projected, plain = [], []
    for p in ctx.spec.params:
        if p.name in targets:
            projected.append(tuple(p.shape))
        elif p.name in ctx.trainable:
            plain.append(weights.numel(ctx, p))
    return projected, plain


def galore_state_bytes(ctx: Ctx) -> int:
    """galore_torch GaLoreAdamW.step state (adamw.py, galore_projector.py, proj_type 'std'): for a projected [m, n]
    weight the orthogonal matrix ([r, n] when m >= n, else [m, r]; rank r <= min(m, n)) and exp_avg / exp_avg_sq of
    the projected gradient ([m, r], else [r, n]), all in the gradient's dtype; any other trainable tensor two Adam
    moments. With fp32 weights get_orthogonal_matrix returns a slice of the SVD's Vh (else U) without copying it,
    so the whole [k, n] (else [m, k]) factor stays referenced (k = min(m, n)); 16-bit weights get a compact cast."""
    projected, plain = _low_rank_split(ctx)
    b, total = ctx.weight_bytes, 2 * sum(plain) * ctx.weight_bytes
    for m, n in projected:
        r = min(GALORE_RANK, m, n)
        kept = min(m, n) if b == 4 else r  # the factor's rows (columns) the orthogonal matrix holds
        total += (kept * n * b + 2 * m * r * b) if m >= n else (m * kept * b + 2 * r * n * b)
    return total


def galore_temp_bytes(ctx: Ctx) -> int:
    """GaLoreAdamW.step's transients, one tensor at a time; the largest of:
    - a projected weight's first step (and every update_proj_gap-th): get_orthogonal_matrix's fp32 copy of a 16-bit
      gradient, torch.linalg.svd(full_matrices=False)'s U [m, k], S [k] and Vh [k, n] (k = min(m, n)), then the
      [m, r] (or [r, n]) product it also forms; the SVD's own solver workspace is not counted;
    - a projected weight's later steps: project_back's full [m, n] and its scaled copy;
    - an unprojected tensor's step: two of its size."""
    projected, plain = _low_rank_split(ctx)
    b = ctx.weight_bytes
    out = 2 * max(plain, default=0) * b
    for m, n in projected:
        r, k = min(GALORE_RANK, m, n), min(m, n)
        svd = (m * n * 4 if b != 4 else 0) + 4 * (m * k + k + k * n) + 4 * max(m, n) * r
        out = max(out, svd, 2 * m * n * b)
    return out


def apollo_state_bytes(ctx: Ctx) -> int:
    """apollo_torch APOLLOAdamW.step state (apollo.py, random_projector.py; proj "random", proj_type "std"): for a
    projected [m, n] weight the random matrix ([r, n] when m >= n, else [m, r]: r x the smaller side) and exp_avg /
    exp_avg_sq of the projected gradient (r x the larger side), all in the gradient's dtype (get_orthogonal_matrix
    draws it in fp32 and casts it back); any other trainable tensor two Adam moments. The 0-d norm it keeps per
    weight (state["scaled_grad"]) is not counted."""
    projected, plain = _low_rank_split(ctx)
    b = ctx.weight_bytes
    return 2 * sum(plain) * b + sum(APOLLO_RANK * (min(m, n) + 2 * max(m, n)) * b for m, n in projected)


def apollo_temp_bytes(ctx: Ctx) -> int:
    """APOLLOAdamW.step's transients, one weight at a time; the largest of:
    - a projected weight's first step (and every update_proj_gap-th): get_orthogonal_matrix's fp32 copy of a 16-bit
      gradient (`data.float()`, alive to its return) beside the fp32 draw and its scaled copy ([r, side] each);
    - a projected weight's later steps: the projected gradient, denom and exp_avg / denom (r x the larger side
      each), beside `p.grad * grad_scaling_factor` and the norm-growth limiter's `scaled_grad / limiter` ([m, n]
      each: the first step has no limiter yet);
    - an unprojected tensor's step: two of its size."""
    projected, plain = _low_rank_split(ctx)
    b = ctx.weight_bytes
    out = 2 * max(plain, default=0) * b
    for m, n in projected:
        draw = (m * n * 4 if b != 4 else 0) + 2 * APOLLO_RANK * min(m, n) * 4
        out = max(out, draw, 3 * APOLLO_RANK * max(m, n) * b + 2 * m * n * b)
    return out


#: the low-rank optimizers' own state and step functions (the others: STATE_FN, optimizer_temp_bytes)
LOW_RANK_STATE = {"galore-adamw": galore_state_bytes, "apollo-adamw": apollo_state_bytes}
LOW_RANK_TEMP = {"galore-adamw": galore_temp_bytes, "apollo-adamw": apollo_temp_bytes}


@per_model("optimizer", "lora_r", "added_tokens")
def optimizer_state_bytes(ctx: Ctx) -> int:
    """Sum of the optimizer's state over trainable tensors (STATE_FN per optimizer)."""
    if ctx.setup.optimizer in LOW_RANK_STATE:
        return LOW_RANK_STATE[ctx.setup.optimizer](ctx)
    fn = STATE_FN[ctx.setup.optimizer]
    states = BNB_8BIT.get(ctx.setup.optimizer)
    # Trainer registers every nn.Embedding weight for 32-bit state with bitsandbytes' GlobalOptimManager
    # (transformers trainer.py create_optimizer: register_module_override(module, "weight", {"optim_bits": 32}))
    override = bool(states) and not libs.older_than("memplan", TRAINER_EMBEDDING_OVERRIDE_SINCE)
    fp32 = sum(states * _numel(shape) * 4 for shape, _ in trainable_tensors(ctx, embeddings=True)) if override else 0
    # identical blocks repeat the same shapes: one call per distinct shape
    counts = Counter(trainable_tensors(ctx, embeddings=False if override else None))
    return fp32 + sum(n * fn(shape, pbytes) for (shape, pbytes), n in counts.items())


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
    - bnb Lion 8/32-bit, paged AdamW 32-bit: one fused kernel per tensor, in place: nothing param-sized.
    - schedule-free AdamW (foreach): the `denom` buffer over the whole group, like adamw.
    - torchao 8-bit / 4-bit AdamW: the compiled step's buffers for the largest quantized tensor
      (compat.TORCHAO_STEP_BYTES).
    """
    opt = ctx.setup.optimizer
    if opt in LOW_RANK_TEMP:
        return LOW_RANK_TEMP[opt](ctx)
    if opt in ("adamw", "schedule-free-adamw"):  # foreach: one buffer the size of every trainable tensor
        return weights.trainable_bytes(ctx)
    if opt in ("adamw-torch-8bit", "adamw-torch-4bit"):
        # torchao steps one tensor at a time in a compiled function: its buffers for the largest quantized tensor
        bits = 8 if opt.endswith("8bit") else 4
        largest = max((n for n in (_numel(s) for s, _ in trainable_tensors(ctx)) if torchao_quantized(n)), default=0)
        return largest * TORCHAO_STEP_BYTES[bits]
    if opt == "adafactor":
        largest, pbytes = max(((_numel(s), b) for s, b in trainable_tensors(ctx)), default=(0, 4))
        return (2 if pbytes == 4 else 4) * largest * 4
    return 0
