"""Ctx: the facts every component needs, resolved once per estimate from (ModelSpec, Setup).

Resolution mirrors what the real libraries do; each rule cites its source.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from memplan import libs
from memplan.model import trainable as select
from memplan.model.compat import attn_impl, setup_problems
from memplan.errors import BadInput
from memplan.setup import NOT_UPCAST, Setup
from memplan.model.spec import Linear, ModelSpec
from memplan.units import DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class Ctx:
    spec: ModelSpec
    setup: Setup
    attn_impl: str  # resolved: eager | sdpa | flash_attention_2
    compute_bytes: int  # c: bytes of the matmul dtype
    residual_bytes: int  # r: bytes of the hidden-state stream between blocks
    weight_bytes: int  # bytes/element of non-quantized weights
    trainable: frozenset[str]  # names of trainable base parameters
    lora: tuple[Linear, ...]  # LoRA-targeted linears (empty unless lora/qlora)
    quantized: frozenset[str]  # names of quantized Linear modules
    vocab: int  # embedding rows incl. added tokens
    src_len: int  # tokens per sample through the encoder (seq2seq/encoder) or the decoder (causal)
    tgt_len: int  # decoder tokens (seq2seq); == src_len for causal
    act_bytes: int = 0  # bytes of the block-internal activations (0: compute_bytes); see resolve()
    #: autocast over a 16-bit model: FSDP computes with its MixedPrecisionPolicy's 16-bit parameters while
    #: accelerate's autocast stays on (memplan.estimator.memory.distributed.compute_ctx)
    autocast_16bit: bool = False

    @property
    def mixed(self) -> bool:
        """Autocast is on: mixed precision, or training a quantized base in 16-bit compute.

        The QLoRA recipe is Trainer bf16=True/fp16=True over peft.prepare_model_for_kbit_training's fp32
        non-quantized weights (memplan's plan files set it). Weights stay fp32 (weight_bytes) and matmuls run in
        compute_bytes either way.
        """
        return self.setup.mixed or (bool(self.quantized) and self.training and self.compute_bytes < 4)

    @property
    def adapter_bytes(self) -> int:
        """Bytes per element of the trainable LoRA weights: fp32 (peft's autocast_adapter_dtype), bf16 where a TRL
        trainer casts them over a bitsandbytes model (Setup.trl_kbit)."""
        return 2 if self.setup.trl_kbit else 4

    @property
    def autocast(self) -> bool:
        """torch.autocast runs: `mixed`, or over a 16-bit model (autocast_16bit).

        The ops on its fp32 list (softmax, log_softmax, nll_loss) compute in fp32 whatever the weights' dtype.
        """
        return self.mixed or self.autocast_16bit

    @property
    def training(self) -> bool:
        return self.setup.mode == "train"


def resolve(spec: ModelSpec, setup: Setup) -> Ctx:
    """Resolve a (spec, setup) pair, raising BadInput for model-dependent problems (all reported together)."""
    spec = _resized_spec(spec, setup)
    problems = setup_problems(spec, setup)
    if problems:
        raise BadInput("setup does not suit " + spec.model_id + ":\n" + "\n".join(f"  - {p}" for p in problems))
    # peft.prepare_model_for_kbit_training casts every non-quantized fp16/bf16 parameter to fp32
    # (peft/utils/other.py, "cast all non INT8 parameters to fp32"), so those weights and the hidden stream are fp32;
    # not on a GPTQ or torchao base (quantization_method "gptq"/"torchao" skip the cast), nor on an FP8 base, which
    # trains without the preparation (transformers' FP8LinearFunction; TRL's trainers prepare only bitsandbytes models)
    quant_train = (setup.quant is not None and setup.mode == "train" and setup.quant not in NOT_UPCAST
                   and not setup.trl_kbit)  # TRL's trainers prepare nothing (Setup.trl_kbit)
    # a quantized model is built in the compute dtype whatever the precision's weight dtype (from_pretrained with
    # the quantization config: transformers keeps no fp32 master copy), so bf16-mixed over GPTQ or FP8 holds bf16
    weight_bytes = 4 if quant_train else int(DTYPE_BYTES[setup.compute_dtype if setup.quant else setup.weight_dtype])
    compute = int(DTYPE_BYTES[setup.compute_dtype])
    trainable, lora, quantized = _selection(spec, setup)
    if setup.quant in ("fp8", "fp8-dynamic") and fp8_dequantized():
        quantized = frozenset()  # held as plain 16-bit Linears
    src = setup.seq_len if setup.mode == "train" else (setup.prompt_len or setup.seq_len)
    tgt = (setup.target_len or setup.seq_len) if spec.arch.kind == "seq2seq" else src
    # bitsandbytes Linear4bit/8bitLt return their output in the input's dtype (nn/modules.py `.to(inp_dtype)`): after
    # k-bit preparation the normed inputs are fp32, so projections and the activations computed from them are fp32
    # even under autocast; autocast still runs the attention matmuls in the compute dtype.
    act = 4 if (quant_train and setup.quant) else compute
    return Ctx(spec=spec, setup=setup, attn_impl=attn_impl(spec, setup), compute_bytes=compute, act_bytes=act,
               residual_bytes=weight_bytes, weight_bytes=weight_bytes, trainable=trainable, lora=lora,
               quantized=quantized, vocab=spec.arch.vocab_size + setup.added_tokens, src_len=src, tgt_len=tgt)


_RETIED: dict[int, tuple[ModelSpec, ModelSpec]] = {}


def reties_head(spec: ModelSpec, setup: Setup) -> bool:
    """Whether resizing the vocabulary (Setup.added_tokens) ties the model's own lm_head again (_resized_spec)."""
    return bool(setup.added_tokens and spec.arch.retie_on_resize) and not libs.older_than("transformers", (5, 0))


def _resized_spec(spec: ModelSpec, setup: Setup) -> ModelSpec:
    """The model as resize_token_embeddings leaves it.

    With added tokens a checkpoint's own lm_head that transformers 5 would tie (Arch.retie_on_resize: flan-t5-xl,
    T0_3B, mt0-xxl) is tied to the shared embedding again: one [vocab, hidden] table fewer in weights, gradients
    and optimizer state. One derived spec per spec (the per-model memo keys on its identity).
    """
    if not reties_head(spec, setup):
        return spec
    target = spec.arch.retie_on_resize
    hit = _RETIED.get(id(spec))
    if hit is None or hit[0] is not spec:
        head = next(p.name for p in spec.params if p.role == "lm_head")
        derived = dataclasses.replace(spec, params=tuple(p for p in spec.params if p.name != head),
                                      tied=spec.tied + ((head, target),))
        hit = _RETIED[id(spec)] = (spec, derived)
    return hit[1]


# ------------------------------------------------------------------------------------------------ per-model memo
# The planner estimates hundreds of setups of one model that differ in batch, sequence, checkpointing; the terms
# that walk every parameter or Linear (weights, quantization state, trainable sets, per-block structure) depend
# only on which tensors train, are adapted or quantized and on their dtype. They are computed once per model and
# such a selection (benchmarks/results/speed.md). The key always holds the fields that decide the selection and
# the dtypes; a memoized term names any other Setup field it reads. tests/test_estimate.py checks every Setup
# field: an estimate after a warm cache equals one from a cold cache.

#: Setup fields that decide Ctx.trainable / lora / quantized and the weight, compute and activation dtypes (task
#: decides the spec itself, which the key holds too).
SELECTION_FIELDS = ("mode", "technique", "trainable", "lora_targets", "quant", "precision", "use_dora",
                    "use_liger_kernel", "train_new_tokens", "added_tokens", "task", "trainer")
_MEMO: dict[tuple, tuple[ModelSpec, object]] = {}  # key -> (spec, value): the spec kept alive so its id stays its own
_MEMO_LIMIT = 20_000
T = TypeVar("T")


def _memo_get(key: tuple, spec: ModelSpec, compute: Callable[[], T]) -> T:
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    value = compute()
    if len(_MEMO) >= _MEMO_LIMIT:
        _MEMO.clear()
    _MEMO[key] = (spec, value)
    return value


def per_model(*fields: str) -> Callable[[Callable[[Ctx], T]], Callable[[Ctx], T]]:
    """Memoize a term f(ctx) per model and selection.

    The key holds the selection fields, the Ctx's resolved dtypes and kernel, the transformers and peft releases
    estimated for (memplan.libs.assume: `memplan check` mixes rows of several releases), and the other Setup
    `fields` the term reads (src_len/tgt_len come from seq_len, target_len, prompt_len: name those). The value is
    shared: return immutable values (frozensets, tuples, numbers).
    """
    names = SELECTION_FIELDS + fields

    def wrap(f: Callable[[Ctx], T]) -> Callable[[Ctx], T]:
        @functools.wraps(f)
        def cached(ctx: Ctx) -> T:
            s = ctx.setup
            if (ctx.trainable, ctx.lora, ctx.quantized) != _selection(ctx.spec, s):
                return f(ctx)  # a Ctx with hand-made sets (dataclasses.replace): not what the key stands for
            key = (f, id(ctx.spec), ctx.weight_bytes, ctx.compute_bytes, ctx.act_bytes, ctx.residual_bytes,
                   ctx.attn_impl, ctx.vocab, ctx.autocast_16bit, *_releases()) + \
                tuple(getattr(s, n) for n in names)
            return _memo_get(key, ctx.spec, lambda: f(ctx))
        return cached
    return wrap


def clear_memo() -> None:
    _MEMO.clear()


def _releases() -> tuple:
    """The library releases a memoized term depends on, as installed or assumed (memplan.libs.assume).

    transformers decides code paths; peft decides LoRA targets on fused experts (select.PEFT_MOE_CONVERSION_SINCE);
    memplan, for a measured row, what its runner did (optimizer.TRAINER_EMBEDDING_OVERRIDE_SINCE); the card planned
    for, whether stored-quantized weights load dequantized (fp8_dequantized, mxfp4_dequantized).
    """
    return (libs.version("transformers"), libs.version("peft"), libs.version("memplan"),
            libs.assumed("compute_capability"))  # the card decides whether FP8 / MXFP4 weights stay quantized


#: the compute capability from which transformers keeps FP8 weights quantized (quantizer_finegrained_fp8.py
#: validate_environment: below 8.9 it sets dequantize=True and loads plain Linears in the model's dtype;
#: quantizer_compressed_tensors.py: below 8.9 use_optimized_inference is ignored and the weights decompress)
FP8_KERNELS_FROM = (8, 9)


#: the compute capability from which transformers keeps MXFP4 experts quantized (quantizer_mxfp4.py
#: validate_environment: below 7.5, or without the `kernels` package, dequantize=True loads them in bf16)
MXFP4_KERNELS_FROM = (7, 5)


def fp8_dequantized() -> bool:
    """FP8 checkpoints load dequantized on the card planned for (known and below FP8_KERNELS_FROM)."""
    return _card_below(FP8_KERNELS_FROM)


def mxfp4_dequantized() -> bool:
    """MXFP4 experts load dequantized to bf16 on the card planned for (known and below MXFP4_KERNELS_FROM); memplan
    assumes the `kernels` package is installed, as transformers asks."""
    return _card_below(MXFP4_KERNELS_FROM)


def _card_below(capability: tuple[int, int]) -> bool:
    cc = libs.assumed("compute_capability")
    if not cc:
        return False
    major, _, minor = cc.partition(".")
    return (int(major), int(minor or 0)) < capability


def _selection(spec: ModelSpec, setup: Setup) -> tuple[frozenset[str], tuple[Linear, ...], frozenset[str]]:
    """What trains, what LoRA adapts and what is quantized, once per selection.

    Returns:
        (trainable base parameter names, LoRA-targeted Linears, quantized Linear names).
    """
    def compute():
        trainable = frozenset(p.name for p in select.trainable_params(spec, setup)) if setup.mode == "train" \
            else frozenset()
        lora = select.lora_linears(spec, setup.lora_targets) if setup.uses_lora else ()
        # MXFP4 converts gpt-oss's fused experts, no Linear (weights.stored_bytes)
        quantized = frozenset(m.name for m in select.quantized_linears(spec)) \
            if setup.quant and setup.quant != "mxfp4" else frozenset()
        return trainable, lora, quantized
    key = ("selection", id(spec), *_releases()) + tuple(getattr(setup, n) for n in SELECTION_FIELDS)
    return _memo_get(key, spec, compute)


