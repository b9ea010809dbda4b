"""Launcher configs for a multi-GPU plan.

An accelerate config file (`accelerate launch --config_file`) and, for DeepSpeed, the DeepSpeed JSON it points
to. Both say exactly what the estimate assumed (sharding, offload, bucket
sizes, micro-batch, accumulation, precision), so the run matches the prediction.

Field names: accelerate's ClusterConfig (accelerate/commands/config/config_args.py) and the keys its
DeepSpeedPlugin / FullyShardedDataParallelPlugin read (accelerate/utils/dataclasses.py); DeepSpeed's config schema
(deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py, offload_config.py).
"""
from __future__ import annotations

from memplan.estimator.memory.distributed import ds_buckets
from memplan.setup import ZERO_STAGES, Setup

#: Setup.precision -> accelerate mixed_precision
MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp16": "fp16"}


def mixed_precision(s: Setup) -> str:
    """accelerate's mixed_precision value for the setup's precision (MIXED_PRECISION)."""
    return MIXED_PRECISION[s.precision]


def deepspeed_config(spec, s: Setup) -> dict:
    """The DeepSpeed JSON for a ZeRO setup.

    Explicit values (no "auto"), so the file also works without the HF Trainer; Trainer checks they agree with its
    TrainingArguments (the plan's training_arguments section does).
    """
    stage = ZERO_STAGES[s.sharding]
    b = ds_buckets(spec.arch.hidden_size)
    zero = {"stage": stage, "overlap_comm": stage == 3, "contiguous_gradients": True,
            "reduce_scatter": True, "reduce_bucket_size": b["reduce_bucket_size"],
            "allgather_bucket_size": b["allgather_bucket_size"]}
    if stage == 3:
        zero.update({k: b[k] for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                       "stage3_max_live_parameters", "stage3_max_reuse_distance")})
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if s.offload in ("optimizer", "params+optimizer"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload == "params+optimizer":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    half = mixed_precision(s)
    extra = {}
    if s.offload != "none":
        # offloading needs DeepSpeed's own CPU Adam (zero_force_ds_cpu_optimizer): an optimizer block; "auto" takes
        # the Trainer's learning rate, betas, eps and weight decay (transformers integrations/deepspeed.py)
        extra["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}}
    return {**extra,
        "train_micro_batch_size_per_gpu": s.batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "train_batch_size": s.batch_size * s.grad_accum * s.world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": half == "bf16"},
        "fp16": {"enabled": half == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }


def fsdp_config(s: Setup) -> dict:
    """accelerate fsdp_config for FSDP2 (fully_shard).

    Transformer-block wrapping (the model's _no_split_modules, what the estimate's units are), reshard after forward
    for full shard, CPU offload of params (+ grads and the optimizer step) when asked, activation checkpointing
    through the Trainer (gradient_checkpointing), not FSDP.
    """
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": s.sharding == "fsdp-full-shard",
        "fsdp_offload_params": s.offload == "params+optimizer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }


def accelerate_config(s: Setup, deepspeed_file: str | None = None) -> dict:
    """The accelerate config file's content for a data-parallel setup (None fields omitted)."""
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": {"ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}[s.engine],
        "num_machines": s.num_nodes,
        "num_processes": s.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed_precision(s),
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if s.engine == "deepspeed":
        # with a config file, accelerate takes precision, accumulation and ZeRO settings from it
        del cfg["mixed_precision"]
        cfg["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file or "deepspeed.json",
                                   "zero3_init_flag": ZERO_STAGES[s.sharding] == 3}
    elif s.engine == "fsdp":
        cfg["fsdp_config"] = fsdp_config(s)
    if s.num_nodes > 1:
        cfg["main_process_ip"] = "MAIN_NODE_IP"
        cfg["main_process_port"] = 29500
    return cfg
