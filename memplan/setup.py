"""The one frozen Setup that flows CLI -> estimate -> search -> export -> validate.

Field names and values are a contract (benchmarks, sweep files and measured CSVs use them). Defaults are
what a Hugging Face Trainer + peft user gets without setting anything (TrainingArguments of transformers 5.x:
fp32, per_device_train_batch_size=8, optim="adamw_torch_fused" with torch >= 2.8; LoraConfig: r=8,
lora_alpha=8, lora_dropout=0.0, peft's default target modules per model type).
Variants are made with `dataclasses.replace`; validation reports every problem at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from memplan.errors import SetupError

Mode = Literal["train", "infer"]
Technique = Literal["full", "lora", "qlora", "freeze"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "fp16", "bf16"]
Quant = Literal["int8", "nf4", "fp4"]
Optimizer = Literal["adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd"]
AttnImpl = Literal["eager", "sdpa", "flash_attention_2"]
Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp-shard-grad-op", "fsdp-full-shard"]
Offload = Literal["none", "optimizer", "params+optimizer"]

MODES: tuple[str, ...] = get_args(Mode)
TECHNIQUES: tuple[str, ...] = get_args(Technique)
PRECISIONS: tuple[str, ...] = get_args(Precision)
QUANTS: tuple[str, ...] = get_args(Quant)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
ATTN_IMPLS: tuple[str, ...] = get_args(AttnImpl)
SHARDINGS: tuple[str, ...] = get_args(Sharding)
OFFLOADS: tuple[str, ...] = get_args(Offload)
#: DeepSpeed ZeRO stages (arXiv:1910.02054 sec. 5: P_os, P_os+g, P_os+g+p) and PyTorch FSDP sharding strategies
ZERO_STAGES: dict[str, int] = {"zero1": 1, "zero2": 2, "zero3": 3}
FSDP_SHARDINGS: tuple[str, ...] = ("fsdp-shard-grad-op", "fsdp-full-shard")
#: fields that describe the GPUs rather than the step on one of them (absent from single-GPU measurement keys)
DISTRIBUTED_FIELDS: tuple[str, ...] = ("num_gpus", "num_nodes", "sharding", "offload")

#: precision -> (dtype the weights are stored in, dtype matmuls run in)
PRECISION_DTYPES: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "fp16-mixed": ("fp32", "fp16"),  # torch.autocast over fp32 weights (Trainer fp16=True)
    "bf16-mixed": ("fp32", "bf16"),  # torch.autocast over fp32 weights (Trainer bf16=True)
    "fp16": ("fp16", "fp16"),  # model.to(torch.float16)
    "bf16": ("bf16", "bf16"),  # model.to(torch.bfloat16)
}

#: memplan dtype name -> torch dtype attribute name (torch.float32, ...): plan files, the tracer
TORCH_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_targets(value):
    """LoRA targets as peft needs them: "all-linear", or a tuple of module names ("q_proj,v_proj" split). peft reads
    a plain string as one regular expression that must match a module's full name, so a comma-separated or bare
    module name string would wrap nothing (tuners_utils.check_target_module_exists)."""
    if not isinstance(value, str):
        return tuple(value) if isinstance(value, list) else value
    if value.strip().lower() == "all-linear":
        return "all-linear"
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_trainable(value):
    """freeze's trainable: N (the last N blocks, "3" included) or a tuple of parameter-name patterns."""
    if isinstance(value, list):
        return tuple(value)
    if not isinstance(value, str):
        return value
    return int(value) if value.strip().isdigit() else tuple(v.strip() for v in value.split(",") if v.strip())


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """What the user wants to run. Each field's comment says its memory effect."""

    mode: Mode = "train"  # infer: weights + KV cache + prefill activations; no grads/optimizer
    technique: Technique = "full"  # which parameters get gradients and optimizer state
    precision: Precision = "fp32"  # weight dtype and compute dtype (PRECISION_DTYPES)
    quant: Quant | None = None  # bitsandbytes base weights: int8 1 B/param, nf4/fp4 0.5 B/param + absmax
    double_quant: bool = False  # 4-bit: absmax quantized to 8 bit (saves ~0.37 bit/param)
    lora_r: int = 8  # adapter rank: r*(in+out) params per targeted Linear
    lora_alpha: int = 8  # scaling only: no memory effect
    lora_dropout: float = 0.0  # > 0: dropout mask + a dropped copy of each targeted layer's input saved
    lora_targets: tuple[str, ...] | str | None = None  # module names, "all-linear", or None = peft's default
    trainable: tuple[str, ...] | int | None = None  # freeze: name patterns, or N = last N blocks (default 1)
    optimizer: Optimizer = "adamw-fused"  # state bytes per trainable param and step temporaries
    batch_size: int = 8  # micro-batch per step: activations and logits scale with it
    seq_len: int = 512  # tokens per sample (padded length); seq2seq: encoder length
    target_len: int | None = None  # seq2seq decoder length (None = seq_len)
    grad_ckpt: bool = False  # keep only block inputs; recompute one block at a time in backward
    grad_accum: int = 1  # micro-steps per optimizer step: no activation effect, grads persist across them
    attn_impl: AttnImpl | None = None  # eager keeps [b,h,s,s] probabilities; None = the model's default
    added_tokens: int = 0  # new special tokens: embedding, lm_head and logits grow
    prompt_len: int | None = None  # infer: prompt tokens (None = seq_len)
    new_tokens: int | None = None  # infer: generated tokens (None = 128 for generative models, 0 for encoders)
    num_gpus: int = 1  # GPUs per node (data-parallel ranks); every memory figure is per GPU
    num_nodes: int = 1  # machines; world size = num_gpus x num_nodes (sharded state divides by it)
    sharding: Sharding = "none"  # ddp replicates all state (+ gradient buckets); zero1/2/3 and fsdp shard it
    offload: Offload = "none"  # DeepSpeed/FSDP CPU offload: optimizer state (and params) live in host RAM

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_targets", parse_targets(self.lora_targets))
        object.__setattr__(self, "trainable", parse_trainable(self.trainable))
        if self.technique == "qlora" and self.quant is None:
            object.__setattr__(self, "quant", "nf4")
        problems = validate(self)
        if problems:
            raise SetupError(problems)

    @property
    def weight_dtype(self) -> str:
        return PRECISION_DTYPES[self.precision][0]

    @property
    def compute_dtype(self) -> str:
        return PRECISION_DTYPES[self.precision][1]

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def engine(self) -> str:
        """Which library runs the data parallelism: "none", "ddp" (torch DDP), "deepspeed" or "fsdp"."""
        if self.sharding in ZERO_STAGES:
            return "deepspeed"
        if self.sharding in FSDP_SHARDINGS:
            return "fsdp"
        return self.sharding

    @property
    def uses_lora(self) -> bool:
        return self.mode == "train" and self.technique in ("lora", "qlora")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("lora_targets", "trainable"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d


def _choice(problems: list[str], name: str, value, allowed: tuple, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        problems.append(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(problems: list[str], name: str, value, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{name} must be an integer >= {minimum}, got {value!r}")


def validate(s: Setup) -> list[str]:
    """Every problem with a Setup's values and combinations (empty when valid). Model-independent."""
    p: list[str] = []
    _choice(p, "mode", s.mode, MODES)
    _choice(p, "technique", s.technique, TECHNIQUES)
    _choice(p, "precision", s.precision, PRECISIONS)
    _choice(p, "quant", s.quant, QUANTS, optional=True)
    _choice(p, "optimizer", s.optimizer, OPTIMIZERS)
    _choice(p, "attn_impl", s.attn_impl, ATTN_IMPLS, optional=True)
    _choice(p, "sharding", s.sharding, SHARDINGS)
    _choice(p, "offload", s.offload, OFFLOADS)
    _positive(p, "num_gpus", s.num_gpus)
    _positive(p, "num_nodes", s.num_nodes)
    _positive(p, "batch_size", s.batch_size)
    _positive(p, "seq_len", s.seq_len)
    _positive(p, "target_len", s.target_len, optional=True)
    _positive(p, "grad_accum", s.grad_accum)
    _positive(p, "lora_r", s.lora_r)
    _positive(p, "added_tokens", s.added_tokens, minimum=0)
    _positive(p, "prompt_len", s.prompt_len, optional=True)
    _positive(p, "new_tokens", s.new_tokens, minimum=0, optional=True)
    if not isinstance(s.lora_dropout, (int, float)) or not 0 <= s.lora_dropout < 1:
        p.append(f"lora_dropout must be in [0, 1), got {s.lora_dropout!r}")
    if s.mode == "train":
        p.extend(_training_combinations(s))
    p.extend(_distributed_combinations(s))
    if s.double_quant and s.quant not in ("nf4", "fp4"):
        p.append("double_quant applies to 4-bit quantization only: add --quant nf4 (or fp4) or drop --double-quant")
    if s.attn_impl == "flash_attention_2" and s.precision == "fp32" and s.quant is None:
        p.append("flash_attention_2 runs in fp16/bf16 only: use --precision bf16-mixed (or bf16), or --attn-impl sdpa")
    return p


def _training_combinations(s: Setup) -> list[str]:
    p: list[str] = []
    if s.technique == "qlora" and s.quant not in ("nf4", "fp4"):
        p.append(f"technique qlora needs a 4-bit base (quant nf4 or fp4), got quant={s.quant!r}; "
                 "for LoRA on an 8-bit base use --technique lora --quant int8")
    if s.technique in ("full", "freeze") and s.quant is not None:
        p.append(f"technique {s.technique} cannot train quantized weights (quant={s.quant}); "
                 "use --technique lora/qlora, or drop --quant")
    if s.trainable is not None and s.technique != "freeze":
        p.append("trainable applies to --technique freeze only")
    if isinstance(s.trainable, int) and not isinstance(s.trainable, bool) and s.trainable < 1:
        p.append(f"trainable as a block count must be >= 1, got {s.trainable}")
    if s.lora_targets is not None and s.technique not in ("lora", "qlora"):
        p.append("lora_targets applies to --technique lora/qlora only")
    if s.technique in ("lora", "qlora") and isinstance(s.lora_targets, tuple) and not s.lora_targets:
        p.append("lora_targets is empty: name modules (e.g. q_proj,v_proj) or use all-linear")
    return p


_SHARDING_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                   "fsdp-shard-grad-op": "FSDP shard-grad-op", "fsdp-full-shard": "FSDP full shard"}
_OFFLOAD_NAMES = {"optimizer": " + CPU optimizer offload", "params+optimizer": " + CPU param/optimizer offload"}


def sharding_label(s: Setup) -> str:
    """How the setup spreads over GPUs, for people: 'ZeRO-3 + CPU optimizer offload on 16 GPUs (2 nodes x 8)'."""
    nodes = f" ({s.num_nodes} nodes x {s.num_gpus})" if s.num_nodes > 1 else ""
    return f"{_SHARDING_NAMES.get(s.sharding, s.sharding)}{_OFFLOAD_NAMES.get(s.offload, '')} on {s.world_size} GPUs{nodes}"


def _distributed_combinations(s: Setup) -> list[str]:
    p: list[str] = []
    if s.sharding not in SHARDINGS or s.offload not in OFFLOADS or not isinstance(s.num_gpus, int) \
            or not isinstance(s.num_nodes, int):
        return p  # reported by the field checks
    if s.mode != "train" and (s.sharding != "none" or s.offload != "none" or s.world_size > 1):
        p.append("num_gpus/num_nodes, sharding and offload apply to training; multi-GPU inference is not modelled "
                 "(estimate one GPU, or use --mode train)")
    elif s.world_size > 1 and s.sharding == "none":
        p.append(f"{s.world_size} GPUs need a data-parallel strategy: add --sharding ddp (full replicas), zero1, "
                 "zero2, zero3, fsdp-shard-grad-op or fsdp-full-shard")
    if s.offload != "none" and s.sharding in ("none", "ddp"):
        p.append(f"offload={s.offload} needs DeepSpeed ZeRO or FSDP: add --sharding zero2 (optimizer offload) or "
                 "--sharding zero3 / fsdp-full-shard")
    if s.offload == "params+optimizer" and s.sharding in ("zero1", "zero2"):
        p.append("parameter offload needs ZeRO stage 3 (DeepSpeed offload_param): use --sharding zero3, or "
                 "--offload optimizer")
    if s.offload != "none" and s.optimizer not in ("adamw", "adamw-fused"):
        p.append(f"CPU offload steps AdamW on the CPU (DeepSpeedCPUAdam; torch AdamW on FSDP's CPU shards), not "
                 f"{s.optimizer}: use --optimizer adamw-fused, or drop --offload")
    if s.engine in ("deepspeed", "fsdp") and s.optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        p.append(f"{s.optimizer} (bitsandbytes) is not supported over ZeRO/FSDP-sharded parameters here: use "
                 "--optimizer adamw-fused or adafactor, or --sharding ddp")
    if s.offload == "optimizer" and s.engine == "fsdp":
        p.append("FSDP offloads parameters, gradients and optimizer state together (CPUOffload(offload_params=True)): "
                 "use --offload params+optimizer, or a ZeRO stage for optimizer-only offload")
    return p
