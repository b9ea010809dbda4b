"""Which setups a model accepts, and what transformers picks when the setup leaves a choice to the model: the
attention implementation. Shared by the estimator, the runtime and the planner, so that each refuses the same setups
with the same message."""
from __future__ import annotations

from memplan import libs
from memplan.errors import BadInput
from memplan.model import trainable as select
from memplan.model.spec import ModelSpec
from memplan.setup import GPTQ, PREQUANTIZED, Setup


#: Families whose transformers class gained sdpa after the oldest release memplan installs with (4.46): T5 and mT5
#: from 5.15 (T5PreTrainedModel._supports_sdpa = True; absent in 4.48.1 and 5.14.0, where from_config(...,
#: attn_implementation="sdpa") raises "does not support an attention implementation through
#: torch.nn.functional.scaled_dot_product_attention").
SDPA_SINCE = {"t5": (5, 15), "mt5": (5, 15)}


def sdpa_supported(spec: ModelSpec) -> bool:
    """The model class supports sdpa in the transformers release estimated for (memplan.libs)."""
    a = spec.arch
    return a.supports_sdpa and not libs.older_than("transformers", SDPA_SINCE.get(a.model_type, ()))


def default_attn_impl(spec: ModelSpec) -> str:
    """What transformers picks without attn_implementation: sdpa where the class supports it
    (PreTrainedModel._check_and_adjust_attn_implementation), else eager."""
    default = spec.arch.default_attn_impl
    return "eager" if default == "sdpa" and not sdpa_supported(spec) else default


def attn_impl(spec: ModelSpec, setup: Setup) -> str:
    """The attention implementation transformers would use: the user's choice, else the model's default."""
    return setup.attn_impl or default_attn_impl(spec)


#: model types Liger Kernel patches (liger_kernel/transformers/monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN, v0.8.2 at
#: ead96b6); for any other, transformers' apply_liger_kernel is a silent no-op
LIGER_MODEL_TYPES = frozenset(
    "deepseek_v4 gemma gemma2 gemma3_text gemma3 gemma4_text gemma4 glm4 glm4v glm4v_moe gpt_oss internvl llama "
    "llama4_text llama4 llava granite mllama mllama_text_model ministral mistral mixtral nemotron olmo2 pixtral olmo3 "
    "qwen2 qwen3 qwen3_moe qwen2_vl qwen2_vl_text qwen2_5_vl qwen2_5_vl_text qwen3_next qwen3_5 qwen3_5_text "
    "qwen3_5_moe qwen3_5_moe_text qwen3_vl qwen3_vl_text qwen3_vl_moe qwen3_vl_moe_text smollm3 phi3 paligemma "
    "falcon_h1 smolvlm hunyuan_v1_dense hunyuan_v1_moe exaone4".split())
#: of those, the text decoders memplan estimates Liger for, whose patch functions were read (apply_liger_kernel_to_
#: llama/mistral/qwen2/qwen3/gemma/gemma2/gemma3_text): RMSNorm blocks with a dense gated MLP of gate_proj/up_proj/
#: down_proj, which LigerSwiGLUMLP / LigerGEGLUMLP replace (MoE, fused gate_up, vision-language: not modelled yet)
LIGER_ESTIMATED = frozenset("llama mistral qwen2 qwen3 gemma gemma2 gemma3_text".split())


def setup_problems(spec: ModelSpec, setup: Setup) -> list[str]:
    """Every reason `setup` does not suit the model, each a message that names the fix; [] if none."""
    a = spec.arch
    p: list[str] = []
    total_len = (setup.prompt_len or setup.seq_len) + (setup.new_tokens or 0) if setup.mode == "infer" else setup.seq_len
    if a.max_positions and total_len > a.max_positions:
        if setup.mode == "infer":
            given = "--prompt-len" if setup.prompt_len else "--seq-len"
            p.append(f"prompt {setup.prompt_len or setup.seq_len} + {setup.new_tokens or 0} new tokens = {total_len} "
                     f"exceed the model's max_position_embeddings ({a.max_positions}); use {given} + --new-tokens "
                     f"<= {a.max_positions}")
        else:
            p.append(f"sequence length {total_len} exceeds the model's max_position_embeddings ({a.max_positions}); "
                     f"use --seq-len <= {a.max_positions}")
    if setup.trainer != "hf" and (a.kind != "causal" or not a.has_lm_head):
        p.append(f"--trainer {setup.trainer} (TRL) is modelled for causal language models (AutoModelForCausalLM); "
                 f"this setup builds {a.auto_class}: use --trainer hf")
    if setup.use_liger_kernel and a.model_type not in LIGER_ESTIMATED:
        why = ("Liger Kernel does not patch it (transformers would train without it, silently)"
               if a.model_type not in LIGER_MODEL_TYPES else "memplan does not model Liger's patches for it yet")
        p.append(f"use_liger_kernel on {a.model_type}: {why}; drop --use-liger-kernel")
    if spec.checkpoint_quant and setup.quant != spec.checkpoint_quant:
        stored = spec.checkpoint_quant if spec.checkpoint_quant in PREQUANTIZED else f"bitsandbytes {spec.checkpoint_quant}"
        p.append(f"{spec.model_id} stores its weights as {stored}, which load as such: "
                 f"use --quant {spec.checkpoint_quant}" + (" (with --technique lora, qlora or an inference mode)"
                                                            if setup.technique in ("full", "freeze") else ""))
    if setup.quant == "mxfp4" and a.model_type != "gpt_oss":
        p.append(f"MXFP4 (transformers' Mxfp4Config) converts gpt-oss's experts only; {a.model_type} has none it "
                 "converts: drop --quant mxfp4")
    if setup.quant == "fp8" and setup.mode == "train" and libs.older_than("transformers", FP8_BACKWARD_SINCE):
        p.append(f"transformers {libs.dotted(libs.version('transformers'))} gives FP8 layers no backward "
                 f"(FP8LinearFunction came in {libs.dotted(FP8_BACKWARD_SINCE)}): LoRA on an FP8 base would pass no "
                 "gradient through them. Upgrade transformers, or estimate serving it with --mode infer")
    if setup.quant in GPTQ and setup.mode == "train" and a.norm == "layernorm":
        p.append(f"LoRA on a GPTQ base of {a.model_type} is not modelled: under autocast its LayerNorms return fp32, "
                 "which gptqmodel's kernel keeps (an fp32 projection and, from the MLP on, an fp32 residual stream); "
                 "estimate QLoRA on the 16-bit base (--technique qlora) instead")
    if setup.attn_impl == "sdpa" and not sdpa_supported(spec):
        since = SDPA_SINCE.get(a.model_type) if a.supports_sdpa else None
        where = (f"before transformers {libs.dotted(since)} (estimating for "
                 f"{libs.dotted(libs.version('transformers'))})") if since else "in transformers"
        p.append(f"{a.model_type} does not support sdpa attention {where}; use --attn-impl eager")
    if setup.attn_impl == "flash_attention_2" and not a.supports_flash:
        p.append(f"{a.model_type} does not support flash_attention_2; use --attn-impl sdpa or eager")
    if setup.grad_ckpt and setup.mode == "train" and not a.supports_grad_ckpt:
        p.append(f"{spec.model_id} does not support gradient checkpointing in transformers "
                 "(supports_gradient_checkpointing is False: ALBERT); use --no-grad-ckpt")
    if setup.target_len is not None and a.kind != "seq2seq":
        p.append("target_len applies to encoder-decoder models only")
    if setup.mode == "infer" and a.kind == "encoder" and setup.new_tokens:
        p.append(f"{spec.model_id} is an encoder: it does not generate; drop --new-tokens")
    if setup.uses_lora and setup.lora_dropout and a.lora_expert_targets:
        wrapped = sorted({m.kind for m in select.lora_linears(spec, setup.lora_targets)} & {"expert", "router"})
        if wrapped:
            # peft/tuners/lora/layer.py ParamWrapper: "does not work with lora_dropout != 0"
            p.append(f"peft adapts {spec.model_id}'s {' and '.join(w + 's' for w in wrapped)} as parameters "
                     "(lora.ParamWrapper), which refuse LoRA dropout: use --lora-dropout 0, or target the attention "
                     "only (e.g. --lora-targets q_proj,v_proj)")
    return p


def check_setup(spec: ModelSpec, setup: Setup) -> None:
    """Raise BadInput for every setup problem the model has (all reported together), then for the parameter
    selection's (unknown LoRA targets or freeze patterns): the checks the estimate makes, for the tracer, the
    validator and the runtime, which build the model without estimating it."""
    problems = setup_problems(spec, setup)
    if problems:
        raise BadInput("setup does not suit " + spec.model_id + ":\n" + "\n".join(f"  - {p}" for p in problems))
    if setup.mode == "train":
        select.trainable_params(spec, setup)
    if setup.uses_lora:
        select.lora_linears(spec, setup.lora_targets)


# ---------------------------------------------------------------------------------------------------- torchao AdamW

#: torchao's low-bit AdamW (Trainer's optim adamw_torch_4bit / adamw_torch_8bit, transformers trainer_optimizer.py:
#: block_size=256): a tensor of at least TORCHAO_MIN_SIZE elements whose size divides by the block gets quantized
#: states (torchao/optim/adam.py _new_buffer); any other keeps plain states in the param dtype.
TORCHAO_MIN_SIZE, TORCHAO_BLOCK = 4096, 256

#: Bytes per element that torchao's compiled per-tensor step (adam.py single_param_adam under torch.compile) holds
#: for a tensor with quantized states. 8-bit: the fp32 exp_avg and exp_avg_sq, kept for the parameter update after
#: the block scales' reductions (inductor's buffers, read from its output code on torch 2.13). 4-bit: also each
#: state's int64 codes (quant_utils.quantize_4bit_with_qmap's torch.where over integer literals), which the strided
#: nibble packing `(codes[::2] << 4) | codes[1::2]` reads back: 8 + 16. Measured on an H100 (torch 2.11, torchao
#: 0.18): 7.9 B on SmolLM2-135M's embedding (8-bit) and 24.0 B on Qwen2.5-0.5B's (4-bit), data/measured/gpu-h100.csv.
#: A tensor with plain states fuses into one kernel: nothing tensor-sized. Per bits: the buffers' bytes per element.
TORCHAO_STEP_BUFFERS = {8: (4, 4), 4: (4, 4, 8, 8)}
TORCHAO_STEP_BYTES = {bits: sum(sizes) for bits, sizes in TORCHAO_STEP_BUFFERS.items()}

#: the transformers release whose FP8Linear trains (integrations/finegrained_fp8.py FP8LinearFunction: the input
#: gradient through the weight dequantized in backward); before it the FP8 kernels' output carries no grad_fn
FP8_BACKWARD_SINCE = (5, 22)

#: gptqmodel's trainable AWQ kernel (AwqGemmFn.forward, qlinear/gemm_awq.py, f4c327a): above this many rows
#: (x.shape[0] x x.shape[1], batch x tokens for peft's 3-D input) it dequantizes the whole weight for a torch.matmul;
#: at or below, the AWQ CUDA GEMM runs split-K with AWQ_SPLIT_K fp32 partials (GPTQMODEL_FP32_ACCUM, on by default).
#: Its Triton fallback (gemm_awq_triton.py, where the CUDA extension cannot be built) switches above 128 rows
AWQ_DEQUANT_ABOVE = 1024
AWQ_SPLIT_K = 8


def torchao_quantized(numel: int) -> bool:
    """Whether torchao's low-bit AdamW quantizes the states of a tensor of `numel` elements."""
    return numel >= TORCHAO_MIN_SIZE and numel % TORCHAO_BLOCK == 0
