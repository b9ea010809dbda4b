"""The one frozen Setup that flows CLI -> estimate -> search -> export -> validate.

Field names and values are a contract (benchmarks, sweep files and measured CSVs use them). Defaults are
what a Hugging Face Trainer + peft user gets without setting anything (TrainingArguments of transformers 5.x:
fp32, per_device_train_batch_size=8, optim="adamw_torch_fused" with torch >= 2.8; LoraConfig: r=8,
lora_alpha=8, lora_dropout=0.0, peft's default target modules per model type).
Variants are made with `dataclasses.replace`; validation reports every problem at once.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, get_args

from memplan.errors import SetupError

Mode = Literal["train", "infer"]
Technique = Literal["full", "lora", "qlora", "freeze"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "fp16", "bf16"]
#: bitsandbytes quantizes on load (int8, nf4, fp4); the others are checkpoints stored quantized (issue 40): GPTQ
#: 4/8-bit and AWQ 4-bit with group size 128 (gptqmodel's QuantLinear layouts), FP8 with 128 x 128 block scales
#: (transformers' FineGrainedFP8, quant_method "fp8"), compressed-tensors' FP8 with per-channel weight scales and
#: dynamic per-token activations (the -FP8-Dynamic uploads, served by transformers' CompressedTensorsFP8Linear),
#: torchao's weight-only tensors (TorchAoConfig with Int4WeightOnlyConfig(group_size=128) / Int8WeightOnlyConfig(),
#: quant_method "torchao")
Quant = Literal["int8", "nf4", "fp4", "gptq-int4", "gptq-int8", "awq", "fp8", "fp8-dynamic", "mxfp4", "torchao-int4",
                "torchao-int8"]
NewTokens = Literal["modules-to-save", "token-indices"]
Task = Literal["causal-lm", "seq2seq", "masked-lm", "seq-cls", "token-cls"]
Optimizer = Literal["adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd", "paged-adamw-32bit",
                    "lion-8bit", "lion-32bit", "paged-lion-8bit", "paged-lion-32bit", "adamw-torch-8bit",
                    "adamw-torch-4bit", "schedule-free-adamw", "galore-adamw",
                    "apollo-adamw"]
AttnImpl = Literal["eager", "sdpa", "flash_attention_2"]
Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp-shard-grad-op", "fsdp-full-shard"]
Offload = Literal["none", "optimizer", "params+optimizer"]
#: the trainer that runs the step: transformers' Trainer, or TRL's SFTTrainer, DPOTrainer, GRPOTrainer (TRL 1.16)
TrainerName = Literal["hf", "sft", "dpo", "grpo"]
VllmMode = Literal["colocate", "server"]

MODES: tuple[str, ...] = get_args(Mode)
TECHNIQUES: tuple[str, ...] = get_args(Technique)
PRECISIONS: tuple[str, ...] = get_args(Precision)
QUANTS: tuple[str, ...] = get_args(Quant)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
ATTN_IMPLS: tuple[str, ...] = get_args(AttnImpl)
SHARDINGS: tuple[str, ...] = get_args(Sharding)
OFFLOADS: tuple[str, ...] = get_args(Offload)
NEW_TOKENS: tuple[str, ...] = get_args(NewTokens)
TRAINERS: tuple[str, ...] = get_args(TrainerName)
#: the stored-quantized formats: weight bits per element of each
PREQUANTIZED: dict[str, int] = {"gptq-int4": 4, "gptq-int8": 8, "awq": 4, "fp8": 8, "fp8-dynamic": 8, "mxfp4": 4,
                                "torchao-int4": 4, "torchao-int8": 8}
#: the GPTQ formats: LoRA trains on them (peft GPTQLoraLinear), and peft's prepare_model_for_kbit_training keeps
#: their 16-bit weights (no fp32 upcast: peft utils/other.py skips it for quantization_method "gptq")
GPTQ = ("gptq-int4", "gptq-int8")
#: the stored formats LoRA trains on: GPTQ, AWQ through gptqmodel's trainable kernel (AwqConfig(backend=
#: "auto_trainable"): AwqGEMMLinear, peft AwqLoraLinear; peft's k-bit preparation upcasts an AWQ model's other
#: weights to fp32, as it does bitsandbytes'), and FP8 through transformers' FP8LinearFunction (an nn.Linear to
#: peft; no k-bit preparation: the model stays in its 16-bit dtype), and torchao's int8 weight-only tensor (peft
#: TorchaoLoraLinear, int8 only; the k-bit preparation exempts torchao from its fp32 upcast)
LORA_PREQUANTIZED = (*GPTQ, "awq", "fp8", "torchao-int8")
#: the stored formats peft's k-bit preparation leaves in the model's dtype (peft utils/other.py: quantization_method
#: "gptq" or "torchao" skip the fp32 upcast) or that train without it (FP8)
NOT_UPCAST = (*GPTQ, "fp8", "torchao-int4", "torchao-int8")
#: The low-rank gradient optimizers as memplan plans, traces and estimates them (optim="galore_adamw" /
#: "apollo_adamw" with optim_target_modules and optim_args): they project the gradients of the Linears whose name
#: holds one of LOW_RANK_TARGETS, with transformers' defaults (trainer_optimizer.py _get_galore_optimizer,
#: _get_apollo_optimizer; proj_type "std" for both)
LOW_RANK_TARGETS: tuple[str, ...] = ("attn", "mlp")
LOW_RANK_ARGS: dict[str, dict[str, object]] = {
    "galore-adamw": {"rank": 128, "update_proj_gap": 200, "scale": 0.25},
    "apollo-adamw": {"rank": 128, "proj": "random", "scale_type": "channel", "update_proj_gap": 200, "scale": 1.0},
}
VLLM_MODES: tuple[str, ...] = get_args(VllmMode)
#: TRL's trainers (memplan.estimator.trainers): a fused, tiled LM head instead of the logits
TRL_TRAINERS: tuple[str, ...] = ("sft", "dpo", "grpo")
#: bitsandbytes quantized on load (transformers sets is_loaded_in_4bit / is_loaded_in_8bit)
BNB_QUANTS: tuple[str, ...] = ("int8", "nf4", "fp4")
#: what TRL's configs change from TrainingArguments (trl/trainer/base_config.py: bf16 = not fp16, i.e. autocast over
#: the fp32 model TRL loads by default; gradient_checkpointing=True): the CLI applies them where the user set nothing
TRL_DEFAULTS: dict[str, dict] = {t: {"precision": "bf16-mixed", "grad_ckpt": True} for t in TRL_TRAINERS}
TASK_NAMES: tuple[str, ...] = get_args(Task)
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
    """What the user wants to run. Each field's comment says its memory effect.

    A field added here changes the key of every stored measurement unless it joins measure.rows.LATER_FIELDS
    (left out of keys at its default): a resumed sweep would then measure everything again
    (tests/integration/test_validate.py test_stored_rows_keep_their_keys)."""

    mode: Mode = "train"  # infer: weights + KV cache + prefill activations; no grads/optimizer
    technique: Technique = "full"  # which parameters get gradients and optimizer state
    precision: Precision = "fp32"  # weight dtype and compute dtype (PRECISION_DTYPES)
    quant: Quant | None = None  # bitsandbytes base weights: int8 1 B/param, nf4/fp4 0.5 B/param + absmax
    double_quant: bool = False  # 4-bit: absmax quantized to 8 bit (saves ~0.37 bit/param)
    #: GPTQ / AWQ / torchao int4: inputs per scale (GPTQConfig / AwqConfig / Int4WeightOnlyConfig group_size; -1 one
    #: group per row): scales, zeros and workspaces grow as it shrinks
    group_size: int = 128
    lora_r: int = 8  # adapter rank: r*(in+out) params per targeted Linear
    lora_alpha: int = 8  # scaling only: no memory effect
    lora_dropout: float = 0.0  # > 0: dropout mask + a dropped copy of each targeted layer's input saved
    lora_targets: tuple[str, ...] | str | None = None  # module names, "all-linear", or None = peft's default
    use_dora: bool = False  # peft DoRA: a trainable magnitude per output row; the weight norm rebuilt each forward
    use_liger_kernel: bool = False  # Liger Kernel: no logits (fused linear cross-entropy), leaner norms and MLPs
    trainable: tuple[str, ...] | int | None = None  # freeze: name patterns, or N = last N blocks (default 1)
    optimizer: Optimizer = "adamw-fused"  # state bytes per trainable param and step temporaries
    batch_size: int = 8  # micro-batch per step: activations and logits scale with it
    seq_len: int = 512  # tokens per sample (padded length); seq2seq: encoder length
    target_len: int | None = None  # seq2seq decoder length (None = seq_len)
    grad_ckpt: bool = False  # keep only block inputs; recompute one block at a time in backward
    grad_accum: int = 1  # micro-steps per optimizer step: no activation effect, grads persist across them
    attn_impl: AttnImpl | None = None  # eager keeps [b,h,s,s] probabilities; None = the model's default
    padded: bool = False  # batches hold padding (attention mask with zeros): sdpa keeps a [b,1,q,k] bias per layer
    added_tokens: int = 0  # new special tokens: embedding, lm_head and logits grow
    #: how LoRA trains the added rows (peft): a full trainable copy of the embedding and lm_head
    #: (modules_to_save) or the new rows only (trainable_token_indices); None: they stay as initialised
    train_new_tokens: NewTokens | None = None
    prompt_len: int | None = None  # infer: prompt tokens (None = seq_len)
    new_tokens: int | None = None  # infer: generated tokens (None = 128 for generative models, 0 for encoders)
    num_gpus: int = 1  # GPUs per node (data-parallel ranks); every memory figure is per GPU
    num_nodes: int = 1  # machines; world size = num_gpus x num_nodes (sharded state divides by it)
    sharding: Sharding = "none"  # ddp replicates all state (+ gradient buckets); zero1/2/3 and fsdp shard it
    offload: Offload = "none"  # DeepSpeed/FSDP CPU offload: optimizer state (and params) live in host RAM
    #: the head the script builds (AutoModelFor...: memplan.model.hf.TASKS): seq-cls / token-cls put a small
    #: classifier where the vocabulary-sized LM head was; None: the language-model head the config names
    task: Task | None = None
    #: TRL (field names as SFTConfig / DPOConfig / GRPOConfig name them; memplan.estimator.trainers). sft, dpo and
    #: grpo score tokens through TRL's fused LM head (trl/trainer/utils.py add_fused_lm_head): no [tokens, vocab]
    #: logits; dpo runs 2 x batch_size rows (chosen and rejected) and a reference forward; grpo generates first
    trainer: TrainerName = "hf"
    packing: bool = False  # sft: BFD packing, which makes batches padding-free
    padding_free: bool = False  # sft: the micro-batch as one row of batch_size x seq_len tokens, no padding
    precompute_ref_log_probs: bool = False  # dpo: reference log-probs computed before training: no reference model
    #: sft, dpo: saved activations copied to host memory in the forward, brought back in the backward
    #: (trl/models/activation_offloading.py; memplan.runtime.offload)
    activation_offloading: bool = False
    num_generations: int = 8  # grpo: completions per prompt; batch_size counts completions
    max_completion_length: int = 512  # grpo: generated tokens per completion (the KV cache and the scored tokens)
    beta: float = 0.0  # grpo: KL coefficient; > 0 loads a reference model (full) or disables the adapter (LoRA)
    #: grpo: micro-batches one generation serves (None: grad_accum, TRL's default): generate() runs batch_size x
    #: this many completions at once; below grad_accum it runs mid-window, with the accumulated gradients alive
    steps_per_generation: int | None = None
    use_vllm: bool = False  # grpo: vLLM generates instead of model.generate()
    vllm_mode: VllmMode = "colocate"  # colocate: vLLM in the training process, on the same card; server: elsewhere
    vllm_gpu_memory_utilization: float = 0.3  # colocate: the fraction of the card's total memory vLLM takes

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
    def trl_kbit(self) -> bool:
        """A TRL trainer over a bitsandbytes model: TRL 1.16's SFT/DPO/GRPO trainers call no
        prepare_model_for_kbit_training (the model keeps its 16-bit dtype) and cast the trainable adapters to bf16
        after get_peft_model, all but DoRA's magnitude (sft_trainer.py: `if _is_quantized_model: ...
        param.data.to(torch.bfloat16)`)."""
        return self.trainer in TRL_TRAINERS and self.quant in BNB_QUANTS and self.mode == "train"

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
        return engine_of(self.sharding)

    @property
    def uses_lora(self) -> bool:
        return self.mode == "train" and self.technique in ("lora", "qlora")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("lora_targets", "trainable"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d


#: (field, allowed values, None allowed)
_CHOICES = (("mode", MODES, False), ("technique", TECHNIQUES, False), ("precision", PRECISIONS, False),
            ("quant", QUANTS, True), ("optimizer", OPTIMIZERS, False), ("attn_impl", ATTN_IMPLS, True),
            ("sharding", SHARDINGS, False), ("offload", OFFLOADS, False), ("train_new_tokens", NEW_TOKENS, True),
            ("task", TASK_NAMES, True), ("trainer", TRAINERS, False), ("vllm_mode", VLLM_MODES, False))
#: (field, smallest value, largest value, None allowed). The largest values are far past any run (a 16M-token
#: sequence, a million samples per micro-batch, 65,536 GPUs per node) and keep every byte count within a float's
#: exact integers: a number of hundreds of digits is refused, not overflowed.
_INTEGERS = (("num_gpus", 1, 2**16, False), ("num_nodes", 1, 2**16, False), ("batch_size", 1, 2**20, False),
             ("seq_len", 1, 2**24, False), ("target_len", 1, 2**24, True), ("grad_accum", 1, 2**20, False),
             ("lora_r", 1, 2**16, False), ("added_tokens", 0, 2**24, False), ("prompt_len", 1, 2**24, True),
             ("new_tokens", 0, 2**24, True), ("num_generations", 1, 2**16, False),
             ("max_completion_length", 1, 2**24, False), ("steps_per_generation", 1, 2**20, True))
#: The integer fields, optional ones included: what a CSV cell of a measured row parses as an int
INTEGER_FIELDS = frozenset(name for name, *_ in _INTEGERS) | {"group_size"}
#: the group sizes the stored formats' kernels take (gptqmodel SUPPORTS_GROUP_SIZE, torchao Int4Tensor); -1: per row
GROUP_SIZES = (-1, 32, 64, 128)
#: the formats whose scales come per group of inputs
GROUPED_QUANTS = ("gptq-int4", "gptq-int8", "awq", "torchao-int4")


def quant_groups(in_features: int, group_size: int) -> int:
    """Rows of scales (and zeros) a grouped format stores for a Linear of `in_features` inputs: one per group of
    group_size inputs, one in all for group_size -1 (per output column)."""
    return -(-in_features // group_size) if group_size > 0 else 1


def value_problems(fields: dict) -> list[str]:
    """The problems of each given Setup field's own value (its vocabulary, its integer range), without the
    combinations: for pins that a search completes, and for validate()."""
    p: list[str] = []
    for name, allowed, optional in _CHOICES:
        value = fields.get(name)
        if name in fields and value not in allowed and not (optional and value is None):
            p.append(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")
    for name, minimum, maximum, optional in _INTEGERS:
        value = fields.get(name)
        if name in fields and (isinstance(value, bool) or not isinstance(value, int)
                               or not minimum <= value <= maximum) and not (optional and value is None):
            big = isinstance(value, int) and abs(value) >= 10**12
            shown = f"a {len(str(abs(value)))}-digit number" if big else repr(value)
            p.append(f"{name} must be an integer from {minimum} to {maximum:,}, got {shown}")
    if "group_size" in fields and fields["group_size"] not in GROUP_SIZES:
        p.append(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))} (-1: one group per row), got "
                 f"{fields['group_size']!r}")
    return p


def validate(s: Setup) -> list[str]:
    """Every problem with a Setup's values and combinations (empty when valid). Model-independent."""
    p = value_problems({f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
    if not isinstance(s.lora_dropout, (int, float)) or not 0 <= s.lora_dropout < 1:
        p.append(f"lora_dropout must be in [0, 1), got {s.lora_dropout!r}")
    if s.mode == "train":
        p.extend(_training_combinations(s))
        p.extend(trainer_problems(s))
        given = [f"--{n.replace('_', '-')}" for n in ("prompt_len", "new_tokens") if getattr(s, n) is not None
                 and not (n == "prompt_len" and s.trainer in ("dpo", "grpo"))]
        if given:
            p.append(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --mode infer only: drop "
                     f"{'it' if len(given) == 1 else 'them'}, or add --mode infer")
    if s.train_new_tokens and not (s.added_tokens and s.mode == "train" and s.technique in ("lora", "qlora")):
        p.append("train_new_tokens chooses how LoRA trains added tokens: it needs --added-tokens N and --technique "
                 "lora or qlora in train mode (full fine-tuning trains every row anyway)")
    if s.use_liger_kernel and s.mode != "train":
        p.append("use_liger_kernel patches the training step (transformers applies it in Trainer.train()): drop "
                 "--use-liger-kernel for --mode infer")
    if s.use_dora and (s.mode != "train" or s.technique not in ("lora", "qlora")):
        p.append("use_dora trains a DoRA adapter: it needs --technique lora or qlora in train mode (drop --use-dora)")
    if s.mode != "train" and s.trainer != "hf":
        p.append(f"--trainer {s.trainer} runs a training step: drop it for --mode infer")
    p.extend(_distributed_combinations(s))
    if s.group_size != 128 and s.quant not in GROUPED_QUANTS:
        p.append(f"group_size applies to {', '.join(GROUPED_QUANTS)} (their scales per group of inputs): add one of "
                 "them as --quant, or drop --group-size")
    if s.double_quant and s.quant not in ("nf4", "fp4"):
        p.append("double_quant applies to 4-bit quantization only: add --quant nf4 (or fp4) or drop --double-quant")
    if s.attn_impl == "flash_attention_2" and s.precision == "fp32" and s.quant is None:
        p.append("flash_attention_2 runs in fp16/bf16 only: use --precision bf16-mixed (or bf16), or --attn-impl sdpa")
    return p


#: TRL fields -> the trainers they apply to, and their defaults are in Setup
_TRL_FIELDS = {"packing": ("sft",), "padding_free": ("sft",), "precompute_ref_log_probs": ("dpo",),
               "activation_offloading": ("sft", "dpo"),
               "num_generations": ("grpo",), "max_completion_length": ("grpo",), "beta": ("grpo",),
               "steps_per_generation": ("grpo",),
               "use_vllm": ("grpo",), "vllm_mode": ("grpo",), "vllm_gpu_memory_utilization": ("grpo",)}


def trainer_problems(s: Setup) -> list[str]:
    """What contradicts the trainer: TRL fields given to another trainer, GRPO's batch rule (grpo_trainer.py:
    generation_batch_size = per_device_train_batch_size x processes x steps_per_generation must divide by
    num_generations), the vLLM fraction, an encoder-decoder step."""
    p: list[str] = []
    defaults = {f.name: f.default for f in dataclasses.fields(Setup)}
    for name, trainers in _TRL_FIELDS.items():
        if getattr(s, name) != defaults[name] and s.trainer not in trainers:
            p.append(f"{name} is a {'/'.join(t.upper() for t in trainers)}Config field: add --trainer {trainers[0]}, "
                     f"or drop --{name.replace('_', '-')}")
    if s.activation_offloading and not s.grad_ckpt and s.trainer in ("sft", "dpo"):
        p.append("activation_offloading without checkpointing is not modelled yet (TRL keeps every tensor saved twice "
                 "within its 5-tensor stash on the device): use --grad-ckpt, TRL's default")
    if s.trainer == "grpo":
        if isinstance(s.num_generations, int) and s.num_generations < 2:
            p.append("GRPO needs num_generations >= 2 (it compares completions of the same prompt): use "
                     "--num-generations 2 or more")
        steps = generation_steps(s)
        counts = (s.batch_size, steps, s.num_gpus, s.num_nodes, s.num_generations)
        sound = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in counts)  # else value_problems
        generation_batch = s.batch_size * steps * s.world_size if sound else 0
        if sound and s.num_generations >= 2 and generation_batch % s.num_generations:
            fits = [g for g in range(2, generation_batch + 1) if generation_batch % g == 0]
            what = "accumulation" if s.steps_per_generation is None else "steps per generation"
            p.append(f"generation_batch_size ({s.batch_size} x {steps} {what} x {s.world_size} GPUs = "
                     f"{generation_batch}) must be divisible by num_generations ({s.num_generations}), as GRPOTrainer "
                     f"requires: use --num-generations {', '.join(map(str, fits[:6])) or 'that divides it'}, or change "
                     "--batch-size / --grad-accum / --steps-per-generation")
        if not isinstance(s.beta, (int, float)) or s.beta < 0:
            p.append(f"beta must be >= 0, got {s.beta!r}")
        u = s.vllm_gpu_memory_utilization
        if not isinstance(u, (int, float)) or not 0 < u < 1:
            p.append(f"vllm_gpu_memory_utilization is a fraction of the card's memory in (0, 1), got {u!r}")
    if s.trainer != "hf" and s.added_tokens:
        p.append(f"--added-tokens with --trainer {s.trainer} is not modelled yet (TRL's fused head reads the resized "
                 "head through peft's wrappers): estimate with --trainer hf, or drop --added-tokens")
    if s.trainer != "hf" and (s.sharding != "none" or s.offload != "none"):
        p.append(f"--trainer {s.trainer} is modelled on one GPU: drop --sharding/--offload, or use --trainer hf")
    return p


def prompt_tokens(s: Setup) -> int:
    """GRPO's prompt length: --prompt-len, else --seq-len (TRL 1.16 has no max_prompt_length; prompts are
    left-padded to the longest in the generation batch). DPO: the prompt tokens of each row, 0 when not given (every
    position scored)."""
    if s.trainer == "grpo":
        return s.prompt_len or s.seq_len
    return (s.prompt_len or 0) if s.trainer == "dpo" else 0


def generation_steps(s: Setup) -> int:
    """GRPO's steps_per_generation: the micro-batches one generate() serves (TRL's default: grad_accum)."""
    return s.steps_per_generation or s.grad_accum


def recomputes_old_logps(s: Setup) -> bool:
    """GRPO scores the generated batch once more under no_grad for the importance ratio when accumulation is not a
    whole number of generations, or when vLLM generates (its importance-sampling correction, on by default)
    (grpo_trainer.py: `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`)."""
    return s.trainer == "grpo" and (s.grad_accum % generation_steps(s) != 0 or s.use_vllm)


def needs_reference_model(s: Setup) -> bool:
    """A second model for the reference: full fine-tuning or freezing under DPO (unless its log-probs are
    precomputed) and GRPO with beta > 0 load one in the policy's dtype (trl/trainer/utils.py create_model_from_path,
    dtype = the policy's); peft's reference is the base with the adapter disabled: no copy."""
    uses = (s.trainer == "dpo" and not s.precompute_ref_log_probs) or (s.trainer == "grpo" and s.beta > 0)
    return uses and s.technique in ("full", "freeze")


def trainer_rows(s: Setup, attention: str) -> Setup:
    """The setup of the sequences the policy's training forward runs (`attention`: the kernel the model resolves):
    dpo's 2 x batch_size rows (chosen and rejected concatenated), grpo's prompt + completion rows, sft's
    padding-free single row of batch_size x seq_len tokens, masked as a padded batch where the kernel needs a mask
    (flash attention reads the documents' boundaries from cu_seqlens)."""
    if s.trainer == "dpo":
        return dataclasses.replace(s, batch_size=2 * s.batch_size)
    if s.trainer == "grpo":
        return dataclasses.replace(s, seq_len=prompt_tokens(s) + s.max_completion_length, prompt_len=prompt_tokens(s))
    if s.trainer == "sft" and (s.packing or s.padding_free):
        return dataclasses.replace(s, batch_size=1, seq_len=s.batch_size * s.seq_len,
                                   padded=attention != "flash_attention_2")
    return s


def _training_combinations(s: Setup) -> list[str]:
    p: list[str] = []
    if s.technique == "qlora" and s.quant not in ("nf4", "fp4"):
        p.append(f"technique qlora needs a 4-bit base (quant nf4 or fp4), got quant={s.quant!r}; "
                 "for LoRA on an 8-bit base use --technique lora --quant int8")
    # torchao int4 and compressed-tensors FP8: their own messages
    lora_base = s.technique == "lora" and s.quant in (*LORA_PREQUANTIZED, "torchao-int4", "fp8-dynamic")
    if s.quant in PREQUANTIZED and s.technique != "full" and not lora_base:
        # gptqmodel's AUTO backend picks Machete/Marlin there, whose SUPPORTS_TRAINING is False (qlinear/__init__.py)
        p.append(f"training {s.technique} on a pre-quantized {s.quant} base is not modelled yet. Estimate "
                 "serving it with --mode infer, LoRA on a GPTQ or AWQ upload (--technique lora --quant gptq-int4 "
                 "or awq), or LoRA on the 16-bit base quantized on load (--technique qlora)")
    if s.optimizer in LOW_RANK_ARGS and s.mode == "train" and s.technique != "full":
        p.append(f"{s.optimizer} projects the gradients of full-rank weights: it needs --technique full "
                 "(with LoRA, train the adapters with adamw)")
    if s.quant == "mxfp4" and s.mode == "train":
        p.append("transformers does not train MXFP4 weights: fine-tuning loads them dequantized "
                 "(Mxfp4Config(dequantize=True)), so estimate the 16-bit model: drop --quant mxfp4")
    fmt = "AWQ" if s.quant == "awq" else "GPTQ"  # the gptqmodel formats the two messages below name
    if s.quant in (*GPTQ, "awq") and s.lora_targets == "all-linear" and s.mode == "train":
        p.append(f"peft's all-linear finds no {fmt} layer (it matches nn.Linear, and gptqmodel's QuantLinear is an "
                 "nn.Module: peft tuners_utils._maybe_include_all_linear_layers): name the modules, e.g. "
                 "--lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    if s.quant in GPTQ and s.mode == "train" and s.compute_dtype == "fp32":
        p.append("LoRA on a GPTQ base computes in 16 bit (its scales are fp16; peft keeps the base's dtype): use "
                 "--precision fp16 or bf16")
    if s.quant == "awq" and s.mode == "train" and s.technique == "lora" and s.compute_dtype != "fp16":
        # transformers' AwqQuantizer.update_dtype casts a bf16 request to fp16 on CUDA; under bf16 autocast the
        # kernel's fp16 matmul would be recast (not modelled)
        p.append("LoRA on an AWQ base computes in fp16 (transformers loads AWQ checkpoints in fp16 on CUDA): use "
                 "--precision fp16-mixed or fp16")
    if s.quant in (*GPTQ, "awq") and s.use_dora:
        p.append(f"peft's {fmt} LoRA layer does not support DoRA ({'GPTQ' if fmt == 'GPTQ' else 'Awq'}LoraLinear "
                 "raises): drop --use-dora, or use --technique qlora on the 16-bit base")
    if s.quant == "fp8-dynamic" and s.mode == "train":
        p.append("compressed-tensors' FP8 kernel path serves only (transformers' CompressedTensorsFP8Linear); "
                 "fine-tuning loads the checkpoint dequantized (CompressedTensorsConfig(dequantize=True)): estimate "
                 "the 16-bit model, dropping --quant fp8-dynamic")
    if s.quant == "torchao-int4" and s.mode == "train" and s.technique == "lora":
        p.append("peft's TorchaoLoraLinear trains on torchao's int8 weights only (it raises on an Int4Tensor): "
                 "use a torchao int8 checkpoint (--quant torchao-int8), or LoRA on the 16-bit base quantized on load "
                 "(--technique qlora)")
    if s.quant == "torchao-int8" and s.use_dora and s.mode == "train":
        p.append("DoRA on a torchao base is not modelled: drop --use-dora")
    if s.quant == "fp8" and s.mode == "train" and s.technique == "lora":
        if s.use_dora:
            p.append("DoRA on an FP8 base is not modelled (peft would rebuild the FP8 weight for its norm): drop "
                     "--use-dora")
        if s.compute_dtype == "fp32":
            p.append("LoRA on an FP8 base computes in 16 bit (transformers' FP8 kernels take bf16/fp16 activations): "
                     "use --precision bf16 or bf16-mixed")
    if s.technique in ("full", "freeze") and s.quant is not None:
        p.append(f"technique {s.technique} cannot train quantized weights (quant={s.quant}); "
                 "use --technique lora/qlora, or drop --quant")
    if s.trainable is not None and s.technique != "freeze":
        p.append("trainable applies to --technique freeze only")
    if isinstance(s.trainable, int) and not isinstance(s.trainable, bool) and s.trainable < 1:
        p.append(f"trainable as a block count must be >= 1, got {s.trainable}")
    if s.lora_targets is not None and s.technique not in ("lora", "qlora"):
        p.append("lora_targets applies to --technique lora/qlora only")
    defaults = {f.name: f.default for f in dataclasses.fields(Setup)}
    changed = [f"--{n.replace('_', '-')}" for n in ("lora_r", "lora_alpha", "lora_dropout")
               if getattr(s, n) != defaults[n]]
    if changed and s.technique not in ("lora", "qlora"):
        p.append(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} a LoRA adapter, which --technique "
                 f"{s.technique} does not train: drop {'it' if len(changed) == 1 else 'them'}, or use --technique lora")
    if s.technique in ("lora", "qlora") and isinstance(s.lora_targets, tuple) and not s.lora_targets:
        p.append("lora_targets is empty: name modules (e.g. q_proj,v_proj) or use all-linear")
    return p


_SHARDING_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                   "fsdp-shard-grad-op": "FSDP shard-grad-op", "fsdp-full-shard": "FSDP full shard"}
_OFFLOAD_NAMES = {"optimizer": " + CPU optimizer offload", "params+optimizer": " + CPU param/optimizer offload"}


def engine_of(sharding: str) -> str:
    """The library that runs a sharding: "none", "ddp" (torch DDP), "deepspeed" or "fsdp"."""
    if sharding in ZERO_STAGES:
        return "deepspeed"
    if sharding in FSDP_SHARDINGS:
        return "fsdp"
    return sharding


def sharding_label(s: Setup) -> str:
    """How the setup spreads over GPUs, for people: 'ZeRO-3 + CPU optimizer offload on 16 GPUs (2 nodes x 8)'."""
    nodes = f" ({s.num_nodes} nodes x {s.num_gpus})" if s.num_nodes > 1 else ""
    return f"{_SHARDING_NAMES.get(s.sharding, s.sharding)}{_OFFLOAD_NAMES.get(s.offload, '')} on {s.world_size} GPUs{nodes}"


def _distributed_combinations(s: Setup) -> list[str]:
    if s.sharding not in SHARDINGS or s.offload not in OFFLOADS or not isinstance(s.num_gpus, int) \
            or not isinstance(s.num_nodes, int) or s.optimizer not in OPTIMIZERS or s.mode not in MODES:
        return []  # reported by the field checks
    return list(distributed_problems(s.mode, s.world_size, s.sharding, s.offload, s.optimizer))


@functools.lru_cache(maxsize=4096)
def distributed_problems(mode: str, world_size: int, sharding: str, offload: str, optimizer: str) -> tuple[str, ...]:
    """What is wrong with a data-parallel combination (empty when it is valid); pure on the five values, cached:
    the planner asks it for every candidate."""
    p: list[str] = []
    if mode != "train" and (sharding != "none" or offload != "none" or world_size > 1):
        p.append("num_gpus/num_nodes, sharding and offload apply to training; multi-GPU inference is not modelled "
                 "(estimate one GPU, or use --mode train)")
    elif world_size > 1 and sharding == "none":
        p.append(f"{world_size} GPUs need a data-parallel strategy: add --sharding ddp (full replicas), zero1, "
                 "zero2, zero3, fsdp-shard-grad-op or fsdp-full-shard")
    if offload != "none" and sharding in ("none", "ddp"):
        p.append(f"offload={offload} needs DeepSpeed ZeRO or FSDP: add --sharding zero2 (optimizer offload) or "
                 "--sharding zero3 / fsdp-full-shard")
    if offload == "params+optimizer" and sharding in ("zero1", "zero2"):
        p.append("parameter offload needs ZeRO stage 3 (DeepSpeed offload_param): use --sharding zero3, or "
                 "--offload optimizer")
    if offload != "none" and optimizer not in ("adamw", "adamw-fused"):
        p.append(f"CPU offload steps AdamW on the CPU (DeepSpeedCPUAdam; torch AdamW on FSDP's CPU shards), not "
                 f"{optimizer}: use --optimizer adamw-fused, or drop --offload")
    if engine_of(sharding) in ("deepspeed", "fsdp") and optimizer not in ("adamw", "adamw-fused", "adafactor", "sgd"):
        bnb = optimizer.endswith(("8bit", "32bit")) and not optimizer.startswith("adamw-torch")
        p.append(f"{optimizer}{' (bitsandbytes)' if bnb else ''} is not supported over ZeRO/FSDP-sharded parameters "
                 "here: use --optimizer adamw-fused or adafactor, or --sharding ddp")
    if offload == "optimizer" and engine_of(sharding) == "fsdp":
        p.append("FSDP offloads parameters, gradients and optimizer state together (CPUOffload(offload_params=True)): "
                 "use --offload params+optimizer, or a ZeRO stage for optimizer-only offload")
    return tuple(p)
