"""Inference: KV cache and the transient working set of one layer during prefill (no autograd)."""
from __future__ import annotations

from memplan.memory.activations import attention_kernel
from memplan.memory.context import Ctx


def kv_cache_bytes(ctx: Ctx) -> int:
    """DynamicCache after generating `new_tokens`: per decoder layer K and V [b, kv_heads, prompt+new-1, head_dim]
    in the model dtype (transformers cache_utils DynamicLayer.update concatenates along the sequence); encoder-
    decoders also cache cross-attention K/V over the encoder length. Encoders keep no cache."""
    a, s = ctx.spec.arch, ctx.setup
    if a.kind == "encoder":
        return 0
    new = s.new_tokens if s.new_tokens is not None else 128
    kv_elems = a.num_kv_heads * a.head_dim * 2  # K and V
    if a.kind == "seq2seq":
        per_layer = kv_elems * (max(new - 1, 0) + ctx.src_len)
    else:
        per_layer = kv_elems * (ctx.src_len + max(new - 1, 0))
    return s.batch_size * a.num_decoder_layers * per_layer * ctx.compute_bytes


def kv_growth_bytes(ctx: Ctx) -> int:
    """torch.cat in DynamicCache allocates the grown K (then V) of one layer while the old one is alive."""
    a = ctx.spec.arch
    layers = max(a.num_decoder_layers, 1)
    return kv_cache_bytes(ctx) // (2 * layers) if a.kind != "encoder" else 0


def prefill_working_bytes(ctx: Ctx) -> int:
    """Largest live set inside one layer while the prompt runs (tensors are freed as soon as unused under no_grad):
    the residual and normed hidden states, q/k/v/out, then the MLP intermediates (gated: gate, up, act(gate),
    product; plain: fc1 out + activation out); eager attention adds [b, heads, s, s] scores + fp32 softmax + cast."""
    a = ctx.spec.arch
    c = ctx.compute_bytes
    t = ctx.setup.batch_size * ctx.src_len
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    k = a.experts_per_token if a.num_experts else 1
    attn = (2 * a.hidden_size + 2 * q_dim + 2 * kv_dim) * c * t
    kernel = attention_kernel(ctx, relative_bias=True)
    if kernel == "eager":
        attn += ctx.setup.batch_size * a.num_heads * ctx.src_len * ctx.src_len * (2 * c + 4)
    elif kernel == "math":  # fp32 q/k/v copies, fp32 scores and their softmax (activations.attention_kernel)
        attn += ctx.setup.batch_size * a.num_heads * ctx.src_len * ctx.src_len * 8 + 3 * q_dim * 4 * t
    mlp = (2 * a.hidden_size * c + (4 if a.mlp_gated else 2) * a.intermediate_size * c * k) * t
    return max(attn, mlp)
