"""Dequantization temporaries of bitsandbytes layers."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory.recording import graph_blocks, gradless_linears
from memplan.estimator.memory.fused_head import trl_head
from memplan.model.compat import AWQ_DEQUANT_ABOVE, AWQ_SPLIT_K
from memplan.setup import GPTQ, PREQUANTIZED
from memplan.estimator.memory.saves import liger_head


#: bytes per weight element live at once while gptqmodel's torch path dequantizes a GPTQ weight: 4-bit, the int32
#: shifted codes (4) and their int8 cast (1); later the int8 codes (1), codes - zeros (1), the gathered fp16 scales
#: (2) and the fp16 product (2) = 6. 8-bit: int16 codes, 2 each: 4 + 2, then 2 + 2 + 2 + 2 = 8
GPTQ_UNPACK_BYTES = {4: 6, 8: 8}
#: of which the dequantized weight itself (fp16, the scales' dtype)
GPTQ_WEIGHT_BYTES = 2
#: bytes per input element live at once while transformers' quantize_fp8_per_row quantizes a Linear's input for
#: compressed-tensors FP8 (integrations/compressed_tensors.py CompressedTensorsFP8Linear): x.float(), x / scale and its
#: clamp, 4 bytes each, before the scaled matmul writes the output
FP8_ROW_QUANT_BYTES = 12


def _gptq_unpack_beyond_weight(ctx: Ctx) -> int:
    """Training on a GPTQ base: the unpacking of the largest quantized weight beyond the dequantized weight it
    yields; 0 otherwise."""
    if not (ctx.setup.quant in GPTQ and ctx.training):
        return 0
    sizes = [m.in_features * m.out_features for m in ctx.spec.linears if m.name in ctx.quantized]
    return max(sizes, default=0) * (GPTQ_UNPACK_BYTES[PREQUANTIZED[ctx.setup.quant]] - GPTQ_WEIGHT_BYTES)


@per_model("grad_ckpt", "batch_size", "seq_len", "prompt_len")
def dequant_temp_bytes(ctx: Ctx) -> int:
    """Bytes of the largest quantized Linear's weight dequantized to the compute dtype.

    bitsandbytes MatMul4Bit (autograd/_functions.py) dequantizes the whole weight to the compute dtype for each
    matmul with more than one token, in forward and again in backward (it saves only the packed weight), so the
    largest quantized Linear exists once in compute dtype at a time. LLM.int8 (MatMul8bitLt) likewise materialises
    an fp16 weight for the input gradient in backward."""
    sizes = [m.in_features * m.out_features for m in ctx.spec.linears if m.name in ctx.quantized]
    if ctx.setup.quant in GPTQ and ctx.training and sizes:
        # gptqmodel's training path (TorchLinear: PackableQuantLinear.dequantize_weight) unpacks the whole weight
        # with torch ops: at most GPTQ_UNPACK_BYTES per weight, its fp16 result included. The result is the copy
        # the matmul saves (_cast_weights) where a graph is recorded; in a checkpointed forward it is freed as well
        return _gptq_unpack_beyond_weight(ctx) + (max(sizes) * GPTQ_WEIGHT_BYTES if ctx.setup.grad_ckpt else 0)
    if ctx.setup.quant == "awq" and ctx.training and sizes:
        return max(awq_forward_temp_bytes(ctx, m) for m in ctx.spec.linears if m.name in ctx.quantized)
    if ctx.setup.quant == "torchao-int8" and sizes:
        # torchao's weight-only Int8Tensor linear (int8_tensor.py, per-row path): torch.mm with the int8 weight cast
        # to the input's dtype, then the per-row scale applied to a second [t, n] product. Training keeps the cast
        # for the input gradient where a graph is recorded (_cast_weights), a checkpointed forward frees it
        return max(sizes) * ctx.compute_bytes if not ctx.training or ctx.setup.grad_ckpt else 0
    if not sizes or ctx.setup.quant in PREQUANTIZED:  # Marlin / FP8 kernels multiply the packed weight directly
        return 0
    return max(sizes) * ctx.compute_bytes


def _awq_rows(ctx: Ctx) -> tuple[int, int]:
    """(batch rows, tokens) of the [b, s, k] input an AWQ layer's kernel sees."""
    b = ctx.setup.batch_size
    return b, b * ctx.setup.seq_len


def awq_forward_temp_bytes(ctx: Ctx, m) -> int:
    """What gptqmodel's trainable AWQ kernel makes beside its output in forward, for Linear `m` (AwqGemmFn.forward,
    qlinear/gemm_awq.py): above AWQ_DEQUANT_ABOVE rows the whole [k, n] weight dequantized to fp16; at or below, the
    split-K GEMM's fp32 partials [AWQ_SPLIT_K, t, n] (gemm_cuda_gen.cu launch_gemm_forward_cuda_fp32_reduce)."""
    _, tokens = _awq_rows(ctx)
    if tokens > AWQ_DEQUANT_ABOVE:
        return m.in_features * m.out_features * GPTQ_WEIGHT_BYTES
    return AWQ_SPLIT_K * tokens * m.out_features * 4


#: FP8's weight block (FineGrainedFP8Config weight_block_size (128, 128))
FP8_BLOCK = 128


@per_model("batch_size")
def backward_dequant_bytes(ctx: Ctx) -> int:
    """LoRA on an AWQ or FP8 base: what the largest quantized Linear's backward makes beside the input gradient it
    returns; 0 otherwise.

    AWQ (gptqmodel AwqGemmFn.backward): the weight dequantized to fp16 again and its transpose repeated once per
    batch row ([b, n, k]) for a bmm with the [b, s, n] output gradient. FP8 (transformers FP8LinearFunction.backward,
    _dequantize_fp8_weight): the [n, k] weight cast to the gradient's dtype, the block scales cast and repeated over
    each block's rows ([ceil(n / 128) x 128, ceil(k / 128)]).
    """
    if not (ctx.setup.quant in ("awq", "fp8") and ctx.training):
        return 0
    shapes = [(m.in_features, m.out_features) for m in ctx.spec.linears if m.name in ctx.quantized]
    if not shapes:
        return 0
    if ctx.setup.quant == "awq":
        b, _ = _awq_rows(ctx)
        return max(k * n for k, n in shapes) * GPTQ_WEIGHT_BYTES * (1 + b)
    cb = ctx.compute_bytes

    def fp8(k: int, n: int) -> int:
        blocks_n, blocks_k = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        return (n * k + blocks_n * blocks_k + blocks_n * FP8_BLOCK * blocks_k) * cb
    return max(fp8(k, n) for k, n in shapes)


def recompute_dequant_bytes(ctx: Ctx) -> int:
    """Training on a GPTQ or AWQ base with checkpointing: what the largest quantized Linear makes while its block is
    recomputed in backward. GPTQ: the unpacking beyond the dequantized weight, which its matmul saves
    (_cast_weights); AWQ: the kernel's forward temporaries (awq_forward_temp_bytes). 0 otherwise."""
    if not ctx.setup.grad_ckpt:
        return 0
    if ctx.setup.quant == "awq" and ctx.training:
        return dequant_temp_bytes(ctx)
    return _gptq_unpack_beyond_weight(ctx)


def autocast_copy_bytes(ctx: Ctx, backward: bool = False, stack: str | None = None) -> int:
    """Autocast weight copies kept from forward to backward in mixed precision.

    Every Linear weight (and the lm_head) is cast to the compute dtype and the matmul saves the cast for the input
    gradient; trainable leaves are also held in autocast's cache until the autocast region exits (torch/csrc/autograd
    ... autocast_mode.cpp cached_cast). With checkpointing, frozen weights' casts inside the checkpointed blocks are
    dropped and re-made in recompute; trainable ones stay cached through the forward, and Linears outside the blocks
    (the lm_head) are not checkpointed. Quantized weights are not cast (bitsandbytes dequantizes instead). Blocks below
    the first trainable one record no graph: their casts are freed at once (recording.graph_blocks). backward=True: once
    the forward's autocast region exits its cache is cleared, so with checkpointing the backward holds the casts outside
    the blocks plus those of the one block being recomputed (torch.utils.checkpoint re-enters autocast for the
    recompute). stack: only the blocks of that stack, as saved for their backward (none with checkpointing)."""
    if not (ctx.mixed and ctx.training):
        return 0

    recorded = graph_blocks(ctx)
    per = _casts_by_block(ctx)
    inside = {k: v for k, v in per.items() if k[1] is not None and k in recorded}
    ckpt = ctx.setup.grad_ckpt
    if stack is not None:
        return 0 if ckpt else sum(n for k, (n, _) in inside.items() if k[0] == stack) * ctx.compute_bytes
    if not ckpt:
        in_blocks = sum(n for n, _ in inside.values())
    elif backward:
        in_blocks = max((n for n, _ in inside.values()), default=0)
    else:
        in_blocks = sum(trains for _, trains in inside.values())
    # Liger's fused loss saves no cast of the head's weight for a backward: the casts it makes are counted with it
    # (logits._flce_forward)
    outside = 0 if liger_head(ctx) or trl_head(ctx) else _outside(per)  # the fused heads cast per tile
    return (outside + in_blocks) * ctx.compute_bytes


def largest_block_cast_bytes(ctx: Ctx, keys) -> int:
    """The autocast copies of the block among `keys` ((stack, index)) whose Linears cast the most.

    That is what its recompute under checkpointing makes and its matmuls save for the input gradient.
    """
    if not (ctx.mixed and ctx.training):
        return 0
    per = _casts_by_block(ctx)
    return max((per[k][0] for k in keys if k in per), default=0) * ctx.compute_bytes


def outside_cast_bytes(ctx: Ctx) -> int:
    """The autocast copies of Linears outside the blocks (the lm_head): alive until the head's backward."""
    if not (ctx.mixed and ctx.training) or liger_head(ctx) or trl_head(ctx):
        return 0
    return _outside(_casts_by_block(ctx)) * ctx.compute_bytes


def _outside(per: dict) -> int:
    """Elements cast outside the blocks, from _casts_by_block's mapping."""
    return sum(n for k, (n, _) in per.items() if k[1] is None)


@per_model("lora_r", "grad_ckpt")
def _casts_by_block(ctx: Ctx) -> Mapping[tuple, tuple[int, int]]:
    """Elements autocast casts and the matmuls save, per block.

    A frozen weight whose matmul input carries no gradient (recording.gradless_linears) is cast and freed at once:
    its matmul saves nothing.

    Returns:
        (stack, block index; None outside the blocks) -> (elements cast and saved there, of which trainable).
    """

    gradless = gradless_linears(ctx)
    per: dict[tuple, tuple[int, int, int]] = {}
    for m, size, trains in _cast_weights(ctx):
        n, t, g = per.get((m.stack, m.block), (0, 0, 0))
        per[(m.stack, m.block)] = (n + size, t + (size if trains else 0),
                                   g + (size if not trains and m.name in gradless else 0))
    # a block whose parameters run several times (ALBERT's shared layer, Arch.block_runs): autocast caches only
    # trainable leaves, so a frozen weight is cast again on every run and each matmul saves its own cast (the
    # gradless ones in the first run only)
    runs = ctx.spec.arch.block_runs
    return MappingProxyType({k: (t + (n - t) * (runs if k[1] is not None else 1) - g, t)
                             for k, (n, t, g) in per.items()})


def cached_cast_bytes(ctx: Ctx, requires_grad: bool = True, head: bool = True) -> int:
    """Autocast's cache over a no-grad pass of a model whose fp32 weights keep requires_grad (inference after
    model.eval(), which leaves it set; TRL's reference model and GRPO's policy in generate()): every Linear weight's
    compute-dtype cast is cached for the autocast region, since caching tests the tensor's requires_grad flag, not
    grad mode (aten/src/ATen/autocast_mode.cpp cached_cast: `arg.requires_grad() && arg.is_leaf()`). 0 without
    autocast over fp32 weights, or with frozen weights (requires_grad False). head=False: the output head does not
    run as a module (TRL's fused head casts its weight chunk by chunk, outside the cache)."""
    if not (requires_grad and ctx.autocast and ctx.weight_bytes == 4):
        return 0
    return sum(size for m, size, _ in _cast_weights(ctx) if head or not m.is_output) * ctx.compute_bytes


def _cast_weights(ctx: Ctx):
    """Every weight a Linear's matmul casts under autocast.

    The base weight unless a quantized layer holds it, and the LoRA adapters on it: fp32 trainable leaves
    (weights.lora_bytes), so autocast casts and caches lora_A and lora_B like any trainable weight.

    Yields:
        (Linear or expert parameter, elements autocast casts, whether they train).
    """
    lora = {m.name for m in ctx.lora}
    r = ctx.setup.lora_r
    # a weight already in the compute dtype is used as is (autocast's cached_cast casts only other dtypes): the
    # 16-bit weights of a GPTQ base, which k-bit preparation leaves unconverted
    base_cast = ctx.weight_bytes != ctx.compute_bytes
    # training on a GPTQ base, every quantized weight is dequantized to the input's dtype and saved by its matmul
    # (gptqmodel TorchLinear._forward_eager: torch.matmul(x, weights)), as a cast is
    gptq = ctx.setup.quant in (*GPTQ, "torchao-int8") and ctx.training  # torchao's int8 linear: its cast, saved
    for m in ctx.spec.linears:
        if m.name in ctx.quantized:
            if gptq:
                yield m, m.in_features * m.out_features, False
        elif base_cast:
            yield m, m.in_features * m.out_features, m.name + ".weight" in ctx.trainable
        if m.name in lora and ctx.adapter_bytes != ctx.compute_bytes:  # bf16 adapters (TRL) are not cast
            yield m, r * m.rank_mult * (m.in_features + m.out_features), True
    if ctx.spec.arch.experts_dense:  # Llama-4's experts run torch.bmm on their [E, in, out] tensors: autocast casts
        # them like Linear weights (grouped_mm has no autocast kernel: the other families' experts are not cast)
        for p in ctx.spec.params:
            if p.role == "expert" and len(p.shape) == 3 and base_cast:
                yield p, p.numel, p.name in ctx.trainable
