"""Plan files: write a Plan as YAML/JSON a training script loads as-is, and load it back as transformers/peft objects.

Sections (each maps to the constructor its name says, so nothing needs translating):
  model               from_pretrained kwargs: id, auto_class, dtype, attn_implementation, quantization_config
                      (BitsAndBytesConfig kwargs), prepare_for_kbit_training (QLoRA / int8 bases)
  peft                LoraConfig kwargs (absent without LoRA)
  freeze              the parameter names that train (technique freeze; every other parameter is frozen)
  training_arguments  TrainingArguments kwargs (TRL plans: the TRL config's, TrainingArguments' fields among them)
  trl                 (TRL plans) the trainer and config classes and the TRL fields the estimate assumed; load_plan
                      builds the config class (SFTConfig, DPOConfig, GRPOConfig) from them and training_arguments
  data                tokenisation and collation: max_length (the padded length the estimate assumes), padding,
                      pad_to_multiple_of, label_pad_token_id
  accelerate          (multi-GPU plans) the accelerate config (memplan.estimator.launch); write_plan also writes it
                      next to the plan as <plan>.accelerate.yaml for `accelerate launch --config_file`
  deepspeed           (ZeRO plans) the DeepSpeed JSON, also written as <plan>.deepspeed.json
  memplan             the prediction (GiB), GPU, budget, headroom, the Setup, alternatives, version
The memory assumptions behind each choice: docs/PLANNER.md.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.planner.budget import need_bytes
from memplan.errors import BadInput, schema_problems
from memplan.fileio import write_text_atomic
from memplan.model.compat import default_attn_impl
from memplan.model.hf import CLASSIFIER_CLASSES
from memplan.setup import LOW_RANK_ARGS, LOW_RANK_TARGETS, TORCH_DTYPE_NAMES, Setup
from memplan.units import GiB
from memplan.estimator.launch import accelerate_config, deepspeed_config
from memplan.model.trainable import new_token_kwargs, trainable_params
from memplan.planner.explain import describe
from memplan import __version__

#: Setup.optimizer -> TrainingArguments.optim (transformers OptimizerNames)
OPTIM_NAMES = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adamw-8bit": "adamw_bnb_8bit",
               "paged-adamw-8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd",
               "paged-adamw-32bit": "paged_adamw_32bit", "lion-8bit": "lion_8bit", "lion-32bit": "lion_32bit",
               "paged-lion-8bit": "paged_lion_8bit", "paged-lion-32bit": "paged_lion_32bit",
               "adamw-torch-8bit": "adamw_torch_8bit", "adamw-torch-4bit": "adamw_torch_4bit",
               "schedule-free-adamw": "schedule_free_adamw", "galore-adamw": "galore_adamw",
               "apollo-adamw": "apollo_adamw"}


def low_rank_training_args(optimizer: str) -> dict:
    """GaLore's / APOLLO's TrainingArguments as memplan estimates and traces them (setup.LOW_RANK_TARGETS,
    setup.LOW_RANK_ARGS); nothing for another optimizer."""
    if optimizer not in LOW_RANK_ARGS:
        return {}
    return {"optim_target_modules": list(LOW_RANK_TARGETS),
            "optim_args": ", ".join(f"{k}={v}" for k, v in LOW_RANK_ARGS[optimizer].items())}


PLAN_FORMAT = 1


def _gib(n: int) -> float:
    return round(n / GiB, 3)


def model_section(spec, s: Setup) -> dict:
    """from_pretrained kwargs. Mixed precision keeps fp32 weights (autocast computes in 16 bit); QLoRA/int8 bases
    are loaded through BitsAndBytesConfig with the compute dtype of the setup."""
    out = {"id": spec.model_id, "auto_class": spec.arch.auto_class, "dtype": TORCH_DTYPE_NAMES[s.weight_dtype],
           "attn_implementation": s.attn_impl or default_attn_impl(spec), "quantization_config": None,
           "prepare_for_kbit_training": False}
    if s.quant in ("nf4", "fp4"):
        out["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": s.quant,
                                      "bnb_4bit_use_double_quant": s.double_quant,
                                      "bnb_4bit_compute_dtype": TORCH_DTYPE_NAMES[s.compute_dtype]}
        if s.engine == "fsdp" or s.sharding == "zero3":
            # FSDP/ZeRO-3 flatten and shard the 4-bit weights together with the 16-bit ones: they must be stored
            # in that dtype (peft's FSDP/DeepSpeed QLoRA guides: bnb_4bit_quant_storage)
            out["quantization_config"]["bnb_4bit_quant_storage"] = TORCH_DTYPE_NAMES[s.compute_dtype]
    elif s.quant == "int8":
        out["quantization_config"] = {"load_in_8bit": True}
    if s.trl_kbit:
        # TRL's trainers prepare no k-bit model: the model loads in its 16-bit compute dtype and TRL casts the
        # adapters to bf16 (Setup.trl_kbit), as the estimate assumes
        out["dtype"] = TORCH_DTYPE_NAMES[s.compute_dtype]
    elif s.quant and s.mode == "train":
        # the estimate assumes peft.prepare_model_for_kbit_training (non-quantized weights cast to fp32)
        out["prepare_for_kbit_training"] = True
    return out


def peft_section(spec, s: Setup) -> dict | None:
    """LoraConfig kwargs; target_modules as the estimate counted them (peft's default when unset)."""
    if not s.uses_lora:
        return None
    targets = s.lora_targets
    if targets is None:
        targets = list(spec.arch.lora_default_targets)
    elif isinstance(targets, tuple):
        targets = list(targets)
    task = CLASSIFIER_CLASSES.get(spec.arch.auto_class) or {"causal": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM"}.get(
        spec.arch.kind)
    return {"r": s.lora_r, "lora_alpha": s.lora_alpha, "lora_dropout": s.lora_dropout, "target_modules": targets,
            "bias": "none", "task_type": task, "use_dora": s.use_dora, **new_token_kwargs(spec, s)}


def training_arguments_section(s: Setup) -> dict:
    half = s.compute_dtype if s.precision != "fp32" else None
    return {
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "bf16": half == "bf16",
        "fp16": half == "fp16",
        "gradient_checkpointing": s.grad_ckpt,
        # transformers' gradient_checkpointing_enable with non-reentrant torch.utils.checkpoint, as estimated
        "gradient_checkpointing_kwargs": {"use_reentrant": False} if s.grad_ckpt else None,
        "optim": OPTIM_NAMES[s.optimizer],
        "use_liger_kernel": s.use_liger_kernel,
        **low_rank_training_args(s.optimizer),
    }


#: Setup.trainer -> (TRL trainer class, its config class)
TRL_CLASSES = {"sft": ("SFTTrainer", "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"),
               "grpo": ("GRPOTrainer", "GRPOConfig")}


def trl_section(s: Setup) -> dict | None:
    """The TRL trainer and config classes and the config fields as estimated (TRL 1.16 names); None for Trainer.
    max_length is the row length the estimate assumed (SFT, DPO: prompt and completion); GRPO's generation batch is
    TRL's default, per_device_train_batch_size x gradient_accumulation_steps completions."""
    if s.trainer not in TRL_CLASSES:
        return None
    trainer, config = TRL_CLASSES[s.trainer]
    fields = {"sft": {"max_length": s.seq_len, "packing": s.packing, "padding_free": s.padding_free or s.packing,
                      "activation_offloading": s.activation_offloading},
              "dpo": {"max_length": s.seq_len, "precompute_ref_log_probs": s.precompute_ref_log_probs,
                      "activation_offloading": s.activation_offloading},
              "grpo": {"num_generations": s.num_generations, "max_completion_length": s.max_completion_length,
                       "beta": s.beta, "use_vllm": s.use_vllm, "vllm_mode": s.vllm_mode,
                       "vllm_gpu_memory_utilization": s.vllm_gpu_memory_utilization,
                       "steps_per_generation": s.steps_per_generation}}[s.trainer]
    return {"trainer_class": trainer, "config_class": config, "config": fields, "trl_version": "1.16"}


def data_section(spec, s: Setup) -> dict:
    """The collator pads each batch to its longest sample (at most max_length). The planner's estimate assumes
    padded batches (Setup.padded: under sdpa every attention then keeps a mask), of max_length tokens: shorter
    batches only use less. A plan made with --no-padded assumes equal-length or packed batches."""
    out = {"max_length": s.seq_len, "truncation": True, "padding": "longest",
           "pad_to_multiple_of": 8 if s.seq_len % 8 == 0 else None, "label_pad_token_id": -100}
    if spec.arch.kind == "seq2seq":
        out["max_target_length"] = s.target_len or s.seq_len
    return out


def plan_document(plan, spec, deepspeed_file: str | None = None) -> dict:
    """The plan file's content (raises BadInput when the plan has no setup). `deepspeed_file`: where the DeepSpeed
    JSON is written (the accelerate section points to it)."""
    if not plan.fits:
        raise BadInput("nothing fits: there is no plan to write")
    s, e = plan.setup, plan.estimate
    doc = {"format": PLAN_FORMAT, "model": model_section(spec, s), "peft": peft_section(spec, s)}
    if s.technique == "freeze":
        doc["freeze"] = {"trainable_parameters": [p.name for p in trainable_params(spec, s)]}
    doc["training_arguments"] = training_arguments_section(s)
    if s.trainer in TRL_CLASSES:
        doc["trl"] = trl_section(s)
    doc["data"] = data_section(spec, s)
    if s.sharding != "none":
        doc["accelerate"] = accelerate_config(s, deepspeed_file)
        if s.engine == "deepspeed":
            doc["deepspeed"] = deepspeed_config(spec, s)
    doc["memplan"] = {
        "version": __version__,
        "gpu": plan.gpu.name, "gpu_memory_gib": _gib(plan.gpu.memory_bytes),
        "prefer": plan.prefer, "effective_batch": plan.effective_batch,
        "achieved_effective_batch": plan.achieved_effective_batch,
        "headroom_fraction": plan.headroom, "headroom_gib": _gib(plan.headroom_bytes),
        "budget_gib": _gib(plan.budget_bytes),
        "predicted": {"peak_allocated_gib": _gib(e.peak_allocated_bytes),
                      "peak_reserved_gib": _gib(e.peak_reserved_bytes),
                      "device_total_gib": _gib(e.device_total_bytes), "need_gib": _gib(need_bytes(e)),
                      "peak_phase": e.peak_phase,
                      "components_gib": {k: _gib(v) for k, v in e.components.items() if v}},
        "setup": s.to_dict(),
        "alternatives": [{"setup": _label(a.setup), "fits": a.fits, "need_gib": _gib(a.need_bytes),
                          "reason": a.reason} for a in plan.alternatives],
    }
    return doc


def _label(s: Setup) -> str:
    return describe(s)


def dumps(doc: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "yaml":
        import yaml
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    raise BadInput(f"format {fmt!r} is not one of yaml, json")


def format_for(path: str | Path, fmt: str | None) -> str:
    """The explicit format, else the file extension's (.json -> json, anything else -> yaml)."""
    return fmt or ("json" if str(path).lower().endswith(".json") else "yaml")


def launcher_paths(path: str | Path) -> tuple[Path, Path]:
    """The launcher files written next to a plan file: <stem>.accelerate.yaml, <stem>.deepspeed.json.

    Returns:
        (accelerate config path, DeepSpeed JSON path)."""
    path = Path(path)
    return path.with_name(path.stem + ".accelerate.yaml"), path.with_name(path.stem + ".deepspeed.json")


def write_plan(plan, spec, path: str | Path, fmt: str | None = None, force: bool = False) -> Path:
    """Write the plan file atomically (a crash never leaves a half-written file), and for a multi-GPU plan the
    accelerate config and DeepSpeed JSON beside it (launcher_paths). A launcher file that exists with other content
    (a user's edit, another plan's) is not overwritten unless `force`. Returns the plan's path."""
    path = Path(path)
    acc_path, ds_path = launcher_paths(path)
    doc = plan_document(plan, spec, deepspeed_file=str(ds_path.resolve()))
    launchers = {ds_path: json.dumps(doc["deepspeed"], indent=2) + "\n"} if "deepspeed" in doc else {}
    if "accelerate" in doc:
        launchers[acc_path] = dumps(doc["accelerate"], "yaml")
    clash = [str(p) for p, text in launchers.items() if p.exists() and p.read_text(errors="replace") != text]
    if clash and not force:
        raise BadInput(f"{' and '.join(clash)} exist{'s' if len(clash) == 1 else ''} with other content: pass "
                       "--force to overwrite, or write the plan elsewhere with -o")
    for p, text in launchers.items():
        write_text_atomic(p, text)
    write_text_atomic(path, dumps(doc, format_for(path, fmt)))
    return path


# ---------------------------------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class LoadedPlan:
    """A plan file as ready objects. `model_kwargs` go to `<auto_class>.from_pretrained(model_id, **model_kwargs)`;
    `prepare_model(model)` applies what the plan assumes after loading (k-bit preparation, freezing, LoRA)."""

    model_id: str
    auto_class: str
    model_kwargs: dict
    training_arguments: object  # transformers.TrainingArguments
    lora_config: object | None  # peft.LoraConfig
    quantization_config: object | None  # transformers.BitsAndBytesConfig
    data: dict
    setup: Setup
    trainable_parameters: tuple[str, ...] | None
    prepare_for_kbit_training: bool
    document: dict

    def model_class(self):
        import transformers
        return getattr(transformers, self.auto_class)

    def prepare_model(self, model):
        """Apply the plan to a loaded model: k-bit preparation (QLoRA/int8), freezing, LoRA. Returns the model."""
        if self.prepare_for_kbit_training:
            import peft
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=self.setup.grad_ckpt,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.trainable_parameters is not None:
            keep = set(self.trainable_parameters)
            for name, p in model.named_parameters():
                p.requires_grad_(name in keep)
        if self.lora_config is not None:
            import peft
            model = peft.get_peft_model(model, self.lora_config)
        return model


def read_plan_document(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise BadInput(f"cannot read plan file {str(path)!r}: {e.strerror}") from None
    import yaml

    try:
        doc = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise BadInput(f"{path} is not a valid plan file: {e}") from None
    missing = [k for k in ("model", "training_arguments", "data", "memplan") if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise BadInput(f"{path} is not a memplan plan file (missing sections: {', '.join(missing)}); "
                       "write one with `memplan plan MODEL -o plan.yaml`")
    try:
        PlanFile.model_validate(doc)
    except ValidationError as e:
        raise BadInput(f"{path} is not a usable plan file:\n{schema_problems(e)}") from None
    return doc


# The parts of a plan file that memplan reads back (load_plan, doctor --from); other keys are the user's to add.
class _ModelSection(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    dtype: Literal["float32", "bfloat16", "float16"]  # setup.TORCH_DTYPE_NAMES
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"]
    auto_class: str = "AutoModelForCausalLM"
    quantization_config: dict[str, Any] | None = None
    prepare_for_kbit_training: bool = False


class _TrlSection(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    config_class: Literal["SFTConfig", "DPOConfig", "GRPOConfig"]
    trainer_class: Literal["SFTTrainer", "DPOTrainer", "GRPOTrainer"]
    config: dict[str, Any] = Field(default_factory=dict)


class _MemplanSection(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    setup: dict[str, Any]
    gpu: str | None = None
    gpu_memory_gib: float | int | None = Field(default=None, gt=0)


class PlanFile(BaseModel):
    """The schema of the sections memplan reads back from a plan file (pydantic names every problem's place)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: _ModelSection
    training_arguments: dict[str, Any]
    data: dict[str, Any]
    memplan: _MemplanSection
    peft: dict[str, Any] | None = None
    freeze: dict[str, list[str]] | None = None
    trl: _TrlSection | None = None


def _arguments_class(doc: dict, planned: dict, overrides: dict) -> tuple[type, dict]:
    """(TrainingArguments, `planned`), or the TRL config class a TRL plan names and `planned` with its fields."""
    import transformers
    section = doc.get("trl")
    if not section:
        return transformers.TrainingArguments, planned
    try:
        import trl
    except ImportError:
        raise BadInput(f"this plan trains with TRL's {section['trainer_class']}: pip install 'memplan[trl]' "
                       "(trl>=1.16) to load it") from None
    clash = sorted(set(overrides) & set(section["config"]))
    if clash:
        raise BadInput(f"these {section['config_class']} fields are planned and set the memory budget: "
                       f"{', '.join(clash)}; re-plan with them pinned instead")
    return getattr(trl, section["config_class"]), {**planned, **section["config"]}


def load_plan(path: str | Path, **training_overrides) -> LoadedPlan:
    """Load a plan file as transformers/peft objects. `training_overrides` are extra TrainingArguments kwargs
    (output_dir, learning_rate, max_steps, ...); they must not change the memory-relevant ones silently, so
    overriding a planned key raises. On a machine without CUDA (a laptop, CI inspecting a plan) the arguments are
    built with use_cpu=True unless the caller says otherwise: transformers refuses bf16 there, and the plan's
    objects are still the ones the GPU run gets."""
    import torch
    import transformers

    doc = read_plan_document(path)
    planned = dict(doc["training_arguments"])
    clash = sorted(set(training_overrides) & set(planned))
    if clash:
        raise BadInput(f"these TrainingArguments are planned and set the memory budget: {', '.join(clash)}; "
                       "re-plan with them pinned instead (e.g. memplan plan ... --batch-size N)")
    planned = {k: v for k, v in planned.items() if v is not None}
    if "use_cpu" not in training_overrides and not torch.cuda.is_available():
        training_overrides = {**training_overrides, "use_cpu": True}
    cls, planned = _arguments_class(doc, planned, training_overrides)
    args = cls(**planned, **training_overrides)
    m = doc["model"]
    qconf = None
    if m.get("quantization_config"):
        q = dict(m["quantization_config"])
        for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
            if key in q:
                q[key] = getattr(torch, q[key])
        qconf = transformers.BitsAndBytesConfig(**q)
    kwargs = {"dtype": getattr(torch, m["dtype"]), "attn_implementation": m["attn_implementation"]}
    if qconf is not None:
        kwargs["quantization_config"] = qconf
    lora = None
    if doc.get("peft"):
        import peft
        lora = peft.LoraConfig(**doc["peft"])
    names = {f.name for f in dataclasses.fields(Setup)}
    setup = Setup(**{k: v for k, v in doc["memplan"]["setup"].items() if k in names})
    freeze = doc.get("freeze") or {}
    trainable = tuple(freeze["trainable_parameters"]) if "trainable_parameters" in freeze else None
    return LoadedPlan(model_id=m["id"], auto_class=m.get("auto_class", "AutoModelForCausalLM"), model_kwargs=kwargs,
                      training_arguments=args, lora_config=lora, quantization_config=qconf, data=dict(doc["data"]),
                      setup=setup, trainable_parameters=trainable,
                      prepare_for_kbit_training=bool(m.get("prepare_for_kbit_training")), document=doc)
