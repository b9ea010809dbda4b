"""Resident model state: base weights, quantization metadata, LoRA adapters."""
from __future__ import annotations

from types import MappingProxyType

import math

from memplan import libs
from memplan.model import trainable as select
from memplan.estimator.memory import new_tokens
from memplan.estimator.memory.context import Ctx, mxfp4_dequantized, per_model
from memplan.setup import PREQUANTIZED, quant_groups

# bitsandbytes 4-bit (Params4bit / QuantState, bitsandbytes/functional.py quantize_4bit): two 4-bit codes per uint8,
# one fp32 absmax per block of 64 weights; with compress_statistics (double quant) the absmax values are themselves
# quantized to uint8 in blocks of 256 with one fp32 absmax per block, plus a 256-entry fp32 code table and an fp32
# offset.
# QLoRA paper (arXiv:2305.14314, sec. 3) gives the same 64/256 block sizes: 0.5 + 32/64 bits -> 0.127 bit/param saved.
NF4_BLOCK = 64
NESTED_BLOCK = 256
# bitsandbytes LLM.int8 (Int8Params): int8 weight plus one fp32 scale per output row (SCB) - arXiv:2208.07339 sec. 3.
INT8_ROW_SCALE_BYTES = 4
#: bytes per element of a quantized Linear's weight: bitsandbytes 4-bit and int8, and the stored formats
#: (PREQUANTIZED: GPTQ/AWQ pack 32 / bits values per int32, FP8 one byte)
QUANT_WEIGHT_BYTES = {"nf4": 0.5, "fp4": 0.5, "int8": 1.0, "gptq-int4": 0.5, "gptq-int8": 1.0, "awq": 0.5, "fp8": 1.0,
                      "fp8-dynamic": 1.0, "torchao-int4": 0.5, "torchao-int8": 1.0}


def numel(ctx: Ctx, p) -> int:
    """Elements of one base parameter as trained, added-token rows included.

    transformers' resize_token_embeddings gives the input embedding and an untied lm_head (the [vocab, hidden]
    parameters) one more row per added token (pad_to_multiple_of=None).
    """
    n = ctx.setup.added_tokens
    if n and p.role in ("embedding", "lm_head") and p.shape[0] == ctx.spec.arch.vocab_size:
        return p.numel + n * (p.numel // p.shape[0])
    return p.numel


def total_numel(ctx: Ctx) -> int:
    """Parameters of the model as built: the inventory's, plus the added-token rows (numel) of the embedding and an
    untied lm_head (issue 42: --added-tokens 3 on gpt2 showed more trainable than total parameters)."""
    return ctx.spec.numel_total + sum(numel(ctx, p) - p.numel for p in ctx.spec.params)


def shape(ctx: Ctx, p) -> tuple[int, ...]:
    """A parameter's shape as trained (numel: added-token rows)."""
    n = numel(ctx, p)
    return p.shape if n == p.numel else (p.shape[0] + ctx.setup.added_tokens,) + tuple(p.shape[1:])


def stored_bytes(ctx: Ctx, p, bytes_per: float) -> float:
    """Bytes of one base parameter stored at `bytes_per` per element.

    A quantized Linear's weight is stored at 0.5 (4-bit) or 1 (int8) byte per element; MXFP4 experts
    (mxfp4_experts) at MXFP4_BYTES, their biases in fp32.
    """
    if p.name.endswith(".weight") and p.name[:-len(".weight")] in ctx.quantized:
        return p.numel * QUANT_WEIGHT_BYTES[ctx.setup.quant]
    if ctx.setup.quant == "awq" and p.name.endswith(".bias") and p.name[:-len(".bias")] in ctx.quantized:
        return p.numel * 2  # gptqmodel's fp16 bias buffer, which peft's fp32 upcast of parameters passes by
    if p.role == "expert" and mxfp4_experts(ctx):
        return p.numel * (MXFP4_BYTES if len(p.shape) == 3 else 4)
    return numel(ctx, p) * bytes_per


#: bytes per weight of an MXFP4 tensor: two E2M1 values per byte and one E8M0 scale byte per 32 values (OCP
#: Microscaling Formats spec v1.0; transformers integrations/mxfp4.py Mxfp4GptOssExperts: uint8 blocks
#: [experts, out, in / 2] and scales [experts, out, in / 32]; the Triton layout the kernels swizzle them into holds
#: the same bytes)
MXFP4_BYTES = 0.5 + 1 / 32


def mxfp4_experts(ctx: Ctx) -> bool:
    """gpt-oss's experts are held in MXFP4 (Mxfp4GptOssExperts: --quant mxfp4 on a card with the kernels), with
    fp32 biases; elsewhere (mxfp4_dequantized) transformers loads them in bf16."""
    return ctx.setup.quant == "mxfp4" and not mxfp4_dequantized()


def weights_bytes(ctx: Ctx) -> int:
    """Bytes of the base weights and registered buffers.

    Non-quantized params x weight dtype bytes + quantized Linear weights x (0.5 | 1) byte, and the registered
    buffers (the inventory's, and those of older releases: release_buffer_bytes). Unique tensors only (tied
    embeddings counted once: ModelSpec lists unique params). Added tokens grow the input embedding and an untied
    lm_head by added_tokens x hidden rows (numel).
    """
    return _resident_bytes(ctx) + release_buffer_bytes(ctx)


@per_model("added_tokens")
def _resident_bytes(ctx: Ctx) -> int:
    """Stored parameters (media parts included) plus the inventory's buffers, once per model and selection."""
    total = sum(stored_bytes(ctx, p, ctx.weight_bytes) for p in ctx.spec.params + ctx.spec.media)
    return int(total) + buffer_bytes(ctx) + new_tokens.extra_weight_bytes(ctx)


#: causal-mask tables that older transformers releases registered on every attention layer,
#: `register_buffer("bias", torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(1, 1, ...))`:
#: GPT2Attention.__init__ until 5.1.0 (gone in 5.2.0) and GPTNeoXAttention._init_bias until 4.48.1 (gone in 4.49.0).
#: The catalog's inventory is built with a release without them.
CAUSAL_MASK_BUFFER_UNTIL = {"gpt2": (5, 2), "gpt_neox": (4, 49)}


def release_buffer_bytes(ctx: Ctx) -> int:
    """The per-layer causal-mask buffers of the release estimated for (CAUSAL_MASK_BUFFER_UNTIL).

    0 where the inventory already lists them (a catalog refreshed with such a release).
    """
    a = ctx.spec.arch
    until = CAUSAL_MASK_BUFFER_UNTIL.get(a.model_type)
    if (not until or not a.max_positions or not libs.older_than("transformers", until)
            or any(b.name.endswith("attn.bias") or b.name.endswith("attention.bias") for b in ctx.spec.buffers)):
        return 0
    return a.num_layers * alloc_bytes(a.max_positions ** 2)


#: bytes per element of the non-floating buffer dtypes transformers registers
_BUFFER_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8}


def buffer_bytes(ctx: Ctx) -> int:
    """Bytes of the registered buffers, each its own allocation.

    GPT-BigCode's causal-mask table alone is n_positions^2 bool bytes, 64 MiB for StarCoder (modeling_gpt_bigcode.py
    GPTBigCodeModel: register_buffer("bias", torch.tril(ones(max_positions, max_positions, dtype=bool)))).
    """
    return sum(alloc_bytes(b.numel * (ctx.weight_bytes if b.dtype == "float" else _BUFFER_ITEMSIZE.get(b.dtype, 8)))
               for b in ctx.spec.buffers)


def alloc_bytes(n: float) -> int:
    """Bytes the CUDA caching allocator hands out for an n-byte tensor: rounded up to 512 B.

    Source: kMinBlockSize, c10/cuda/CUDACachingAllocator.cpp round_size; torch.cuda.max_memory_allocated counts
    these rounded sizes.
    """
    return int(-(-int(n) // 512) * 512)


def nf4_state_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of the metadata of one 4-bit weight.

    fp32 absmax per 64 weights; with double quant uint8 absmax per 64 weights + fp32 absmax per 256 of those
    blocks + an fp32 offset (the 256-entry code table is shared, see quant_state_bytes).
    """
    blocks = math.ceil(numel / NF4_BLOCK)
    if not double_quant:
        return alloc_bytes(blocks * 4)
    return alloc_bytes(blocks) + alloc_bytes(math.ceil(blocks / NESTED_BLOCK) * 4) + alloc_bytes(4)


@per_model("double_quant", "group_size")
def quant_state_bytes(ctx: Ctx) -> int:
    """Bytes of the quantization metadata of every quantized Linear.

    nf4_state_bytes per tensor (int8: one fp32 row scale per output feature), plus bitsandbytes' shared 256-entry
    fp32 dynamic code table used by double quant.
    """
    s = ctx.setup
    total = 0
    for m in ctx.spec.linears + ctx.spec.media_linears:
        if m.name not in ctx.quantized:
            continue
        if s.quant in PREQUANTIZED:
            total += prequantized_state_bytes(s.quant, m.in_features, m.out_features, ctx.training, s.group_size)
        elif s.quant == "int8":
            total += alloc_bytes(m.out_features * INT8_ROW_SCALE_BYTES)
        else:
            total += nf4_state_bytes(m.in_features * m.out_features, s.double_quant)
    shared_code = alloc_bytes(256 * 4) if s.double_quant and total else 0
    return total + shared_code


#: GPTQ/AWQ group size (GPTQConfig/AwqConfig group_size, 128 in nearly every published upload) and FP8's block
#: (FineGrainedFP8Config weight_block_size, default (128, 128))
QUANT_GROUP = 128
#: ints of a Marlin kernel's per-layer workspace (gptqmodel utils/marlin.py: int32 [max(SMs, 128)]; 132 on an H100)
MARLIN_WORKSPACE_INTS = 132


def prequantized_state_bytes(quant: str, k: int, n: int, training: bool = False, group: int = QUANT_GROUP) -> int:
    """Bytes beside the packed weight of one stored-quantized Linear [k in, n out] as the default CUDA kernel holds
    it for inference (the packed weight itself: QUANT_WEIGHT_BYTES).

    GPTQ: gptqmodel's QuantLinear holds qweight int32 [k x bits / 32, n], qzeros int32 [k / g, n x bits / 32], scales
    fp16 [k / g, n] and g_idx int32 [k]; "auto" picks Marlin (Machete on Hopper), which repacks qweight at the same
    size, empties qzeros and (without desc_act) g_idx, and adds a per-layer int32 workspace. AWQ (AwqMarlin): qweight
    int32 [k, n x 4 / 32], qzeros int32 [k / g, n x 4 / 32] and scales fp16 [k / g, n] kept, the same workspace. FP8
    (transformers integrations/finegrained_fp8.py FP8Linear): weight float8_e4m3 [n, k] and weight_scale_inv fp32
    [ceil(n / 128), ceil(k / 128)]. training (LoRA on a GPTQ base): the trainable TritonV2 kernel keeps the stored
    layout, qzeros, scales and g_idx beside qweight, and no workspace; on an AWQ base AwqGEMMLinear keeps qzeros and
    scales, no workspace. torchao (quantization/quantize_/workflows, 0.18): Int8Tensor holds int8 qdata [n, k], an fp32
    scale and an int8 zero_point per row; Int4Tensor (the default plain packing) two int4 per byte [n, k / 2], a 16-bit
    scale and zero_point per group of 128 inputs [k / g, n]."""
    groups = quant_groups(k, group)
    workspace = alloc_bytes(4 * MARLIN_WORKSPACE_INTS)
    if quant.startswith("gptq") and training:
        bits = PREQUANTIZED[quant]
        return alloc_bytes(groups * math.ceil(n * bits / 32) * 4) + alloc_bytes(groups * n * 2) + alloc_bytes(k * 4)
    if quant.startswith("gptq"):
        return alloc_bytes(groups * n * 2) + workspace
    if quant == "fp8-dynamic":  # CompressedTensorsFP8Linear: an fp32 weight_scale [1, n] per output channel
        return alloc_bytes(n * 4)
    if quant == "torchao-int8":  # Int8Tensor per row: fp32 scale [n, 1] and int8 zero_point [n, 1]
        return alloc_bytes(n * 4) + alloc_bytes(n)
    if quant == "torchao-int4":  # Int4Tensor (plain): scale and zero_point [k / g, n] in the model's 16-bit dtype
        return 2 * alloc_bytes(groups * n * 2)
    if quant == "awq":  # training: gptqmodel's AwqGEMMLinear keeps the same tensors, without a workspace
        return alloc_bytes(groups * n * 2) + alloc_bytes(groups * math.ceil(n * 4 / 32) * 4) + \
            (0 if training else workspace)
    return alloc_bytes(math.ceil(n / QUANT_GROUP) * math.ceil(k / QUANT_GROUP) * 4)


@per_model("lora_r")
def lora_numel(ctx: Ctx) -> int:
    """LoRA adapter parameters: r x (in + out) per targeted Linear.

    lora_A [r, in], lora_B [out, r] (Hu et al., arXiv:2106.09685).
    """
    return adapter_numel(ctx, ctx.lora)


def adapter_numel(ctx: Ctx, linears) -> int:
    """Adapter elements on `linears`: r x rank_mult x (in + out) each; with DoRA also the magnitude, one per output
    feature (peft lora/dora.py DoraLinearLayer.update_layer: the weight's row norms as a Parameter)."""
    r = ctx.setup.lora_r
    dora = ctx.setup.use_dora
    return sum(r * m.rank_mult * (m.in_features + m.out_features) + (m.out_features if dora else 0) for m in linears)


def trained_lora(ctx: Ctx) -> tuple:
    """The targeted Linears whose adapters get gradients.

    All but those on modules that never get one (select.gets_no_grad: DeepSeek-V3.2's indexer, whose top-k output
    carries no gradient, so its adapters' .grad stays None and AdamW keeps no state for them).
    """
    return tuple(m for m in ctx.lora if not select.gets_no_grad(ctx.spec, m.name))


@per_model("lora_r")
def trained_lora_numel(ctx: Ctx) -> int:
    """Elements of the adapters that get gradients (trained_lora)."""
    return adapter_numel(ctx, trained_lora(ctx))


def lora_bytes(ctx: Ctx) -> int:
    """Bytes of the LoRA adapters, which are fp32.

    peft's get_peft_model(autocast_adapter_dtype=True) upcasts bf16/fp16 adapter weights to float32 (peft
    tuners_utils `_cast_adapter_dtype`); on an fp32 base they are fp32 anyway. Includes the adapters on a composite
    model's media parts, which never train (media_lora_numel).
    """
    magnitude = dora_magnitude_numel(ctx, ctx.lora)
    return (lora_numel(ctx) + media_lora_numel(ctx) - magnitude) * ctx.adapter_bytes + magnitude * 4


def dora_magnitude_numel(ctx: Ctx, linears) -> int:
    """DoRA's magnitude vectors on `linears` (one per output feature of each): fp32 even where TRL casts the other
    adapter weights to bf16 (Ctx.adapter_bytes)."""
    return sum(m.out_features for m in linears) if ctx.setup.use_dora else 0


@per_model("lora_r")
def media_lora_numel(ctx: Ctx) -> int:
    """Adapters peft puts on a composite model's vision tower and projector (select.media_lora_linears)."""
    if not ctx.setup.uses_lora or not ctx.spec.media_linears:
        return 0
    return adapter_numel(ctx, select.media_lora_linears(ctx.spec, ctx.setup.lora_targets))


@per_model("added_tokens", "lora_r")
def trainable_numel(ctx: Ctx) -> int:
    """Parameters that get gradients: selected base params (with their added-token rows) and LoRA adapters."""
    return (sum(numel(ctx, p) for p in ctx.spec.params if p.name in ctx.trainable) + trained_lora_numel(ctx)
            + sum(shape[0] * shape[1] for shape, _, _ in new_tokens.extra_trainable(ctx)))


@per_model("added_tokens", "lora_r")
def trainable_bytes(ctx: Ctx) -> int:
    """Bytes of the trainable tensors themselves (= gradient bytes: grads take the param dtype)."""
    base = sum(numel(ctx, p) for p in ctx.spec.params if p.name in ctx.trainable)
    extra = sum(shape[0] * shape[1] * b for shape, b, _ in new_tokens.extra_trainable(ctx))
    dora = dora_magnitude_numel(ctx, trained_lora(ctx))
    return base * ctx.weight_bytes + (trained_lora_numel(ctx) - dora) * ctx.adapter_bytes + dora * 4 + extra


@per_model("added_tokens", "lora_r")
def stack_trainable_bytes(ctx: Ctx) -> MappingProxyType:
    """stack ("encoder" | "decoder") -> trainable_bytes of the parameters and adapters inside that stack's blocks."""
    out: dict[str, int] = {}
    for p in ctx.spec.params:
        if p.stack and p.name in ctx.trainable:
            out[p.stack] = out.get(p.stack, 0) + numel(ctx, p) * ctx.weight_bytes
    for m in trained_lora(ctx):
        if m.stack:
            out[m.stack] = out.get(m.stack, 0) + adapter_numel(ctx, [m]) * 4
    return MappingProxyType(out)


@per_model()
def output_head(ctx: Ctx):
    """The output embedding Linear when its weight trains (tied: the embedding it shares trains), else None."""
    tied = dict(ctx.spec.tied)
    for m in ctx.spec.linears:
        weight = m.name + ".weight"
        if m.is_output and (weight in ctx.trainable or tied.get(weight) in ctx.trainable):
            return m
    return None

