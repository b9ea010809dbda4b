"""Where q, k and v come from, for what a block keeps beside the attention's own saves.

Rotary positions (q and k come out of the rotation as new tensors) and one fused q/k/v projection whose output a
view keeps alive.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory.saves import autocast_casts_norm_input
from memplan.model.layout import blocks
from memplan.model.spec import norm_case


@per_model()
def rotary_positions(ctx: Ctx) -> bool:
    """Rotary positions (q and k come out as new tensors), not a learned position embedding (GPT-2's wpe)."""
    return not any(p.role == "pos_embedding" for p in ctx.spec.params)


def attn_in_linears(ctx: Ctx) -> list:
    """The q/k/v projections (layout slot attn_in) of the first block outside an encoder: one fused Linear or more."""

    first = next((b for b in blocks(ctx.spec) if b.stack != "encoder"), None)
    return [m for slot, m in first.linears if slot == "attn_in"] if first else []


def fused_qkv_pin_bytes(ctx: Ctx, attn_in: list, kernel: str, q_dim: int, kv_dim: int, qk_norm: bool = False,
                        trains: bool = False) -> float:
    """Per token, the part of a fused q/k/v projection's output that a saved view keeps alive beyond attn_core.

    One Linear makes q, k and v (ModernBERT's Wqkv, Phi-3's qkv_proj) and rotary makes q and k new tensors, while V
    stays a view of that output, which the fused kernel saves: the whole output stays alive, its q and k parts
    beyond attn_core's count. Not where a training cache copies V first (causal models without checkpointing;
    before 4.56 the cache pins it: inference.training_cache_bytes), nor without rotary (GPT-2: q is a view too,
    FUSED_QKV_CACHE).
    """
    a = ctx.spec.arch
    if qk_norm and len(attn_in) == 1 and ctx.training and _norm_saves_input(ctx, trains):
        # q/k norms that save their input save views of the fused output (Persimmon's q_layernorm / k_layernorm read
        # the split of query_key_value's output): V's part stays alive beside the q and k parts they count
        out = attn_in[0].out_features
        return (out - q_dim - kv_dim) * ctx.act_bytes if out >= q_dim + 2 * kv_dim else 0.0
    if kernel != "fused" or len(attn_in) != 1 or not ctx.training or (
            a.kind == "causal" and not ctx.setup.grad_ckpt) or not rotary_positions(ctx):
        return 0.0
    return (attn_in[0].out_features - kv_dim) * ctx.act_bytes if attn_in[0].out_features >= q_dim + 2 * kv_dim else 0


def _norm_saves_input(ctx: Ctx, trains: bool) -> bool:
    """The family's norm saves its input tensor itself when it reads the compute dtype.

    Measured per family: Arch.norm_saves' third value (LayerNorm); without a measurement, a LayerNorm does.
    """

    table = ctx.spec.arch.norm_saves
    if autocast_casts_norm_input(ctx, ctx.act_bytes, trains):  # it saves an fp32 copy instead
        return False
    if table and len(table[0]) > 2:
        return table[norm_case(ctx.act_bytes, trains)][2] > 0
    return ctx.spec.arch.norm != "rmsnorm"
