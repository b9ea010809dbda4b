"""Fused mixture-of-experts layers: what one block's experts save for backward, and peft's LoRA copies of them.

transformers 5 holds [E, out, in] expert parameters and runs them through grouped_mm.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx
from memplan.model.layout import BlockLayout
from memplan.estimator.memory.weights import adapter_numel
from memplan.model import trainable as select


def expert_params(ctx: Ctx, blk: BlockLayout) -> list:
    """The fused expert tensors of a block (transformers 5 MoE: [E, out, in] parameters, not Linears)."""
    if not ctx.spec.arch.num_experts:
        return []
    return [p for p in ctx.spec.params if p.role == "expert" and p.block == blk.index and p.stack == blk.stack]


def routers(ctx: Ctx, blk: BlockLayout) -> list:
    """The block's transformers-5 routers as Linears (select.router_linear): they read the MLP's normed input."""

    if not ctx.spec.arch.num_experts:
        return []
    found = (select.router_linear(ctx.spec, p) for p in ctx.spec.params if p.block == blk.index and p.stack == blk.stack)
    return [r for r in found if r is not None]


def expert_width(ctx: Ctx, experts: list) -> int:
    """Each expert's intermediate width, from its down_proj, [E, H, I] or GPT-OSS's [E, I, H] (Qwen2-MoE's
    moe_intermediate_size is not intermediate_size); intermediate_size where `experts` hold no down_proj."""
    h = ctx.spec.arch.hidden_size
    widths = [max(p.shape[1:], key=lambda d: d != h) for p in experts
              if p.name.endswith("down_proj") and len(p.shape) == 3]
    return widths[0] if widths else ctx.spec.arch.intermediate_size


def moe_bytes(ctx: Ctx, experts: list, lora_names: set[str]) -> float:
    """Bytes per token a block's fused experts save for backward.

    transformers integrations/moe.py grouped_mm_experts_forward: each token visits k experts; the matmuls run in the
    experts' weight dtype - _grouped_mm casts its input to weight.dtype and aten::_grouped_mm has no autocast kernel, so
    bf16-mixed and QLoRA (peft casts the unquantized experts to fp32) compute them in fp32. Saved per visit: the gate_up
    output [2I] and act(gate) [I]; the product [I] when down_proj needs a weight gradient; the down output [H] (the
    routing-weight multiply); the gathered input [H] when gate_up needs one.
    """
    a = ctx.spec.arch
    h = a.hidden_size
    # Llama-4's dense experts run their own torch.bmm (no transformers experts-interface dispatch), which autocasts
    e, i = ctx.act_bytes if a.experts_dense else ctx.weight_bytes, expert_width(ctx, experts)
    # the gate_up output [2I] and act(gate) [I], or what the family's own gating keeps (Arch.expert_gate_saves)
    gating = a.expert_gate_saves[0 if e < 4 else 1] if a.expert_gate_saves else 3 * e

    def grads(suffix: str) -> bool:
        return any(p.name.endswith(suffix) and (p.name in ctx.trainable or p.name in lora_names) for p in experts)
    up, down = grads("gate_up_proj") or grads("up_proj"), grads("down_proj")
    # the routing-weight multiply keeps the down output; Llama-4 multiplies before the experts instead, keeping the
    # repeated input in the residual stream's dtype (fp32 under bf16-mixed)
    route = h * (ctx.residual_bytes if a.experts_dense else e)
    visits = a.num_experts if a.experts_dense else a.experts_per_token  # Llama-4: every expert sees every token
    return visits * (i * gating + (i * e if down else 0) + route + (h * e if up else 0))


def expert_lora_copy_bytes(ctx: Ctx, experts: list, lora_names: set[str], casts: bool = True) -> int:
    """The W + BA copies peft's LoRA makes of fused expert tensors, which grouped_mm saves.

    peft (tuners/lora/layer.py ParamWrapper) forms W + BA with baddbmm: a full copy of each targeted expert tensor in
    its dtype every forward, which grouped_mm saves for the input gradient.
    """
    copies = sum(p.numel for p in experts if p.name in lora_names) * ctx.weight_bytes
    if ctx.weight_bytes >= 4 or not casts:
        return copies
    # the fold casts the fp32 factors to the experts' dtype (ParamWrapper.get_delta_factors: `lhs.to(param.dtype)`),
    # and baddbmm saves those casts

    names = {p.name for p in experts}
    return copies + adapter_numel(ctx, [m for m in ctx.lora if m.kind == "expert" and m.name in names]) * ctx.weight_bytes


def largest_expert_lora_copy_bytes(ctx: Ctx) -> int:
    """The largest single W + BA copy (expert_lora_copy_bytes) of any expert tensor.

    Its gradient is a working tensor of that block's backward.
    """
    if not ctx.spec.arch.num_experts or not ctx.lora:
        return 0
    lora = {m.name for m in ctx.lora}
    return max((expert_lora_copy_bytes(ctx, [p], lora, casts=False) for p in ctx.spec.params if p.role == "expert"),
               default=0)


#: act(gate) tensors of intermediate width alive at the gated product, by family: the default gate (transformers
#: integrations/moe.py _default_apply_gate: act(gate), then act(gate) * up) keeps 2; gpt-oss's
#: (GptOssExperts._apply_gate) the clamped gate and up, the GLU, up + 1 and their product: 5
INFERENCE_GATE_LIVE = {"gpt_oss": 5}


def inference_expert_bytes(ctx: Ctx, tokens: int) -> int:
    """The most a block's fused experts hold at once in a no-grad forward of `tokens` tokens, beyond its input
    (transformers 5 grouped_mm_experts_forward; integrations/moe.py), per route (token x expert visit), in the
    experts' weight dtype:
    - at the gate: the gathered input [H], the per-route gate_up biases [2I] where the experts have biases, the gate_up
      output [2I] (kept until reassigned) and the gate's own tensors (INFERENCE_GATE_LIVE);
    - after the down projection: the gathered input, the per-route down biases, the down output [H], its
      routing-weight product [H] and that product put back in token order [H] (each held by a local until the
      function returns or reassigns it)."""
    a = ctx.spec.arch
    h = a.hidden_size
    first = min((p.block for p in ctx.spec.params if p.role == "expert"), default=None)  # DeepSeek: dense blocks first
    experts = [p for p in ctx.spec.params if p.role == "expert" and p.block == first]
    i = expert_width(ctx, experts)
    bias = any(p.name.endswith("gate_up_proj_bias") for p in experts)
    gate = h + (2 * i if bias else 0) + 2 * i + INFERENCE_GATE_LIVE.get(a.model_type, 2) * i
    down = h + (h if bias else 0) + 3 * h
    return tokens * a.experts_per_token * max(gate, down) * ctx.weight_bytes
