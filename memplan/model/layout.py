"""Where each Linear sits inside a transformer block, from its module name (pure, cached per ModelSpec).

Slots: "attn_in" (q/k/v or fused qkv: read the normed hidden state), "cross_kv" (cross-attention k/v: read the
encoder output), "cross_q" (the cross-attention's query: reads the decoder's state after self-attention),
"attn_out", "mlp_in" (gate/up/fc1: read the normed hidden state), "mlp_out" (down/fc2), "router" (MoE gate),
"mlp_gate" (a gate beside an MoE block's experts that reads their input: Qwen2-MoE's shared_expert_gate), "other".

Names follow the transformers modeling files of each family (llama/mistral/qwen2/gemma: q_proj..down_proj;
gpt2/gpt_bigcode: c_attn, c_proj, c_fc; bloom/falcon/gpt_neox: query_key_value, dense, dense_h_to_4h,
dense_4h_to_h; t5: q,k,v,o, wi/wi_0/wi_1, wo; bart/opt: q_proj.., out_proj, fc1, fc2; bert: query, key, value,
attention.output.dense, intermediate.dense, output.dense; phi: dense, fc1, fc2; phi3: qkv_proj, gate_up_proj;
mixtral: w1, w2, w3, gate; distilbert: q_lin.., out_lin, lin1, lin2; deberta-v2: query_proj..; modernbert: Wqkv,
attn.Wo, mlp.Wi, mlp.Wo; albert: ffn, ffn_output; deepseek_v2/v3 MLA: q_a_proj and kv_a_proj_with_mqa read the
normed hidden state, q_b_proj and kv_b_proj their low-rank latents ("other")).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from memplan.model.spec import Linear, ModelSpec

#: the attribute names transformers gives a model's ModuleList of blocks (`model.layers`, GPT-2's `transformer.h`,
#: T5's `encoder.block`, BERT's `encoder.layer`, ALBERT's shared `albert_layers`)
BLOCK_LIST_NAMES = ("layers", "layer", "h", "block", "blocks")
BLOCK_LISTS = "|".join(BLOCK_LIST_NAMES + ("albert_layers",))
#: `...layers.3.` inside a parameter or module name: group 1 is the block index
BLOCK_INDEX = re.compile(rf"\.(?:{BLOCK_LISTS})\.(\d+)\.")

_ATTN_IN = {"q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "c_attn", "query_key_value",
            "qkv_proj", "Wqkv", "q_attn", "q_lin", "k_lin", "v_lin", "query_proj", "key_proj", "value_proj",
            "q_a_proj", "kv_a_proj_with_mqa"}
_MLP_IN = {"gate_proj", "up_proj", "gate_up_proj", "wi", "wi_0", "wi_1", "fc1", "c_fc", "dense_h_to_4h", "w1", "w3",
           "fc_in", "lin1", "Wi", "ffn"}
_MLP_OUT = {"down_proj", "wo", "fc2", "dense_4h_to_h", "w2", "fc_out", "lin2", "ffn_output"}
_CROSS = ("encoder_attn.", "EncDecAttention.", "crossattention.", "cross_attn.")
#: Linears that read the MLP's input beside mlp_in without being part of the MLP: Qwen2-MoE's sigmoid gate on its
#: shared expert (modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock.forward:
#: `self.shared_expert_gate(hidden_states_reshaped)`, the tensor the shared expert's gate_proj and up_proj read).
_MLP_GATE = {"shared_expert_gate"}


def slot(m: Linear, num_experts: int = 0) -> str:
    """The slot of one Linear (see module docstring)."""
    short = m.short_name
    parent = m.name.rsplit(".", 2)[-2] if m.name.count(".") >= 1 else ""
    cross = any(c in m.name for c in _CROSS)
    if short in _ATTN_IN:
        if cross:
            return "cross_kv" if short in {"k_proj", "v_proj", "k", "v", "key", "value"} else "cross_q"
        return "attn_in"
    if short in _MLP_IN:
        return "mlp_in"
    if short in _MLP_OUT:
        return "mlp_out"
    if short in ("o_proj", "o", "out_proj", "out_lin"):
        return "attn_out"
    if short == "Wo":  # ModernBERT: attn.Wo, mlp.Wo
        return "mlp_out" if parent == "mlp" else "attn_out"
    if short == "c_proj":
        return "attn_out" if parent in ("attn", "attention", "crossattention") else "mlp_out"
    if short == "dense":
        # bert: attention.output.dense (attn out) vs layer.N.output.dense (mlp out) vs intermediate.dense (mlp in)
        if parent == "intermediate":
            return "mlp_in"
        if ".attention." in m.name or parent in ("self_attention", "self_attn", "attention", "attn"):
            return "attn_out"
        return "mlp_out" if parent == "output" else "other"
    if short == "gate" and num_experts and m.out_features == num_experts:
        return "router"
    if short in _MLP_GATE:
        return "mlp_gate"
    return "other"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Linears of one block grouped by slot."""

    stack: str | None
    index: int
    linears: tuple[tuple[str, Linear], ...]  # (slot, linear)
    norms: int = 2  # normalisation layers (weights) over the hidden size in the block, from the inventory
    #: elements per token of the block's query/key norms (QK-norm: Qwen3, OLMo2, Gemma-3): a per-head norm's weight
    #: has head_dim elements but normalises every head, num_heads x head_dim (q) or num_kv_heads x head_dim (k)
    qk_norm_widths: tuple[int, ...] = ()
    #: widths of the block's other norms that do not normalise the hidden size (BitNet's ffn_sub_norm over the
    #: intermediate size, DeepSeek's q_a_layernorm / kv_a_layernorm over the low ranks)
    other_norm_widths: tuple[int, ...] = ()

    def by_slot(self) -> dict[str, list[Linear]]:
        """The block's Linears per slot, in the block's order."""
        out: dict[str, list[Linear]] = {}
        for sl, m in self.linears:
            out.setdefault(sl, []).append(m)
        return out


#: module names of query/key norms (modeling_qwen3 / modeling_gemma3 / modeling_olmo2 `q_norm`, `k_norm`;
#: StableLM and Cohere's `q_layernorm`, `k_layernorm`; HunYuan's `query_layernorm`, `key_layernorm`; `q_layer_norm`,
#: `k_layer_norm`): the names transformers 5.24 gives every per-head norm built over head_dim on queries or keys
_QK_NORMS = {"q_norm": "q", "q_layernorm": "q", "q_layer_norm": "q", "query_layernorm": "q",
             "k_norm": "k", "k_layernorm": "k", "k_layer_norm": "k", "key_layernorm": "k"}


def _qk_norm(name: str) -> tuple[str, str] | None:
    """(module path, "q" | "k") of a query/key norm's parameter, None for any other norm."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _QK_NORMS:
            return ".".join(parts[:i + 1]), _QK_NORMS[part]
    return None


_CACHE: dict[int, tuple[ModelSpec, tuple[BlockLayout, ...]]] = {}


def blocks(spec: ModelSpec) -> tuple[BlockLayout, ...]:
    """Every block of the model with its slotted linears, in (stack, index) order; cached per spec object."""
    hit = _CACHE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    groups: dict[tuple[str | None, int], list[tuple[str, Linear]]] = {}
    for m in spec.linears:
        if m.block is None or m.is_output:
            continue
        groups.setdefault((m.stack, m.block), []).append((slot(m, spec.arch.num_experts), m))
    a = spec.arch
    width = {"q": a.num_heads * a.head_dim, "k": a.num_kv_heads * a.head_dim}
    norms: dict[tuple[str | None, int], int] = {}
    other: dict[tuple[str | None, int], list[int]] = {}
    qk: dict[tuple[str | None, int], dict[str, int]] = {}
    for p in spec.params:
        if p.role == "norm" and p.block is not None and not p.name.endswith(".bias"):
            key, side = (p.stack, p.block), _qk_norm(p.name)
            if side:  # one entry per norm module (StableLM keeps a LayerNorm per head in a ModuleList)
                qk.setdefault(key, {})[side[0]] = width[side[1]]
            elif p.shape[0] != a.hidden_size:
                other.setdefault(key, []).append(p.shape[0])
            else:
                norms[key] = norms.get(key, 0) + 1
    order = {"encoder": 0, None: 1, "decoder": 2}
    keys = sorted(groups, key=lambda k: (order.get(k[0], 1), k[1]))
    # one layout per run of a block whose parameters run several times (Arch.block_runs: ALBERT's shared layer)
    out = tuple(BlockLayout(k[0], k[1], tuple(groups[k]), norms.get(k, 0) + a.weightless_norms,
                            tuple(qk.get(k, {}).values()), tuple(other.get(k, ())))
                for k in keys for _ in range(a.block_runs))
    _CACHE[id(spec)] = (spec, out)
    return out
