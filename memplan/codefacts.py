"""Facts about a model's memory that live in its transformers code rather than its config, read from the source of
the classes and functions it runs when its inventory is built (memplan.inventory): they follow the installed
release and cover families no hand-kept list names."""
from __future__ import annotations

import re


#: an RMSNorm forward that applies its weight in fp32 and casts after: `(self.weight * hidden_states).to(...)`
#: (OLMo2), `* (1.0 + self.weight.float())` (Gemma, Gemma-2, Gemma-3), `self.weight.to(torch.float32) * ...`
_FP32_WEIGHT = re.compile(r"\(self\.weight \* hidden_states\)\.to\(|self\.weight\.float\(\)|"
                          r"self\.weight\.to\(torch\.float32\)")


def norm_weight_fp32(model) -> bool:
    """Whether the model's RMSNorm multiplies by its weight before casting back to the input dtype, so the
    normalised tensor a trainable weight saves is fp32 whatever the model dtype (Llama's casts first:
    `self.weight * hidden_states.to(input_dtype)`). Read from the first RMSNorm class's forward. The list it
    replaces (gemma, gemma2) missed Gemma-3 (-3.4% full bf16) and OLMo2 (-2.5%) shapes."""
    import inspect

    for module in model.modules():
        if "RMSNorm" in type(module).__name__:
            try:
                return bool(_FP32_WEIGHT.search(inspect.getsource(type(module).forward)))
            except (OSError, TypeError):  # no source: Llama's order, the common case
                return False
    return False


#: a softmax call that runs in fp32: `softmax(x, dim=-1, dtype=torch.float32)` (Llama's eager_attention_forward and
#: every family generated from it), or on an fp32 copy, `softmax(scores.float(), ...)` (T5 before 5.15)
_FP32_SOFTMAX = re.compile(r"softmax\([^\n]*(dtype=torch\.float32|\.float\(\))")


def eager_softmax_fp32(model) -> bool:
    """Whether the model's eager attention takes its softmax in fp32 (fp32 probabilities plus a compute-dtype copy),
    read from its modeling module as installed: the module's `eager_attention_forward`, or where a family has none
    (Falcon, BLOOM, GPT-J) the source of its attention classes. Llama and the families generated from it do; GPT-2,
    BERT, BART, T5 (5.15 on) and Falcon do not. A list of families missed every new one: Gemma-3, Qwen2-MoE, Qwen3
    and the other shapes in benchmarks/shapes (pure bf16 eager: a Gemma-3-shaped config LoRA b2 s512 -11.1%)."""
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "eager_attention_forward", None)
    try:
        if fn is not None:
            source = inspect.getsource(fn)
        else:
            source = "\n".join(inspect.getsource(c) for name, c in vars(module).items()
                               if isinstance(c, type) and "Attention" in name and c.__module__ == module.__name__)
    except (OSError, TypeError):  # no source (a frozen or compiled module): Llama's fp32 softmax, the common case
        return True
    return bool(_FP32_SOFTMAX.search(source))



def peft_expert_targets(model_type: str) -> tuple[str, ...]:
    """The LoRA target names peft moves onto a transformers-5 MoE family's fused expert tensors and router, as
    "old:new" pairs (("down_proj:down_proj", "gate:gate.weight", "gate_proj:gate_up_proj", "up_proj:gate_up_proj")
    for the qwen2_moe pattern); () where peft converts nothing. peft (utils/transformers_weight_conversion.py
    `_convert_peft_config_moe`, peft 0.21) converts a family whose checkpoint conversion mapping exists and whose
    `_MODEL_TO_CONVERSION_PATTERN` base ("mixtral", "qwen2_moe") has target and fused-target mappings: all-linear and
    named targets then adapt the experts and the router instead of every Linear with an old name (a shared expert's
    or a dense block's gate_proj/up_proj/down_proj are left out). Read from the installed peft; a peft without the
    module converts nothing. A hand-kept {"mixtral"} missed OLMoE, Qwen3-MoE, MiniMax, DeepSeek-V2/V3, dots1 and the
    other qwen2_moe-pattern families: an OLMoE-shaped config LoRA all-linear bf16 -20.9%, Qwen3-MoE -7.5%
    (benchmarks/shapes)."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ModuleNotFoundError as e:  # an older peft: no conversion, no fused experts adapted
        if e.name != "peft.utils.transformers_weight_conversion":
            raise
        return ()
    base = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    mapping = conv._MOE_TARGET_MODULE_MAPPING.get(base)
    if not mapping or not conv._MOE_FUSED_TARGETS.get(base) or conv.get_checkpoint_conversion_mapping(model_type) is None:
        return ()
    return tuple(sorted(f"{old}:{new}" for old, new in mapping.items()))
