"""DeBERTa-v2's disentangled attention (Arch.disentangled): what its position terms save beyond a plain attention.

transformers models/deberta_v2/modeling_deberta_v2.py, DisentangledSelfAttention.forward and
disentangled_attention_bias, per layer in training:
- each layer drops out the shared relative embeddings (`self.pos_dropout`, hidden_dropout_prob): a bool mask and the
  dropped [2 x span, hidden] rows, which query_proj / key_proj save as their input;
- c2p: `torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))` saves pos_key_layer, the projected rows repeated
  over the batch ([b x heads, 2 x span, head_dim]); `torch.gather(c2p_att, -1, index=c2p_pos.expand(...))` saves its
  input, the [b x heads, s, 2 x span] scores against every relative position (aten's gather backward reads `self`),
  and its index, an expanded view of one [s, s] int64 clamp of the relative positions (not per sample);
- p2c: likewise pos_query_layer and its own [s, s] int64 index, and `torch.bmm(key_layer, ...)` saves key_layer
  itself (the plain scores save the scaled copy `key_layer.transpose(-1, -2) / scale`, a new tensor).
Under LoRA the frozen rows record nothing of their own; each adapter on query_proj / key_proj saves its cast of
them (peft's fp32 adapters). Everything else (the gathered [b x heads, s, s] terms, the sum) is transient.
Counted with saved_tensors_hooks on a one-layer deberta-v3-xsmall (bf16, 1 x 512, 2 x 512, 1 x 256 tokens) and
checked against the tracer.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.saves import lora_saves


def disentangled_bytes(ctx: Ctx, tokens: int, seq: int, linears=(), lora_names=frozenset()) -> float:
    """Bytes one DeBERTa-v2 attention layer saves for its position terms, `tokens` = batch x `seq`; `linears` the
    block's Linears, `lora_names` those LoRA adapts."""
    a = ctx.spec.arch
    kinds, rows = a.disentangled
    if not kinds or not ctx.training:
        return 0.0
    c, d = ctx.act_bytes, a.head_dim
    batch = tokens // max(seq, 1)
    if any("rel_embeddings" in name for name in ctx.trainable):  # full fine-tuning: the rows' path records
        dropped = rows * a.hidden_size * (c + 1) if a.hidden_dropout > 0 else 0  # output and bool mask
    else:  # frozen rows: only LoRA branches on query_proj / key_proj (share_att_key) record, saving their own cast
        dropped = sum(lora_saves(ctx, m.in_features, c, m)[0] for m in linears
                      if m.name in lora_names and m.name.endswith(("query_proj", "key_proj"))) * rows
    # the gather's [b x heads, s, 2 x span] input, the repeated projection, the int64 gather index
    per_kind = batch * a.num_heads * rows * (seq + d) * c + seq * seq * 8
    p2c_key = tokens * a.num_heads * d * c if kinds == 2 else 0
    return dropped + kinds * per_kind + p2c_key
