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
