"""Facts about a model's memory that live in its transformers (and peft) code rather than its config.

Read from the source of the classes and functions it runs, or measured by running one of its layers on meta or
fake tensors, when its inventory is built (memplan.inventory.build): they follow the installed release and cover
families no hand-kept list names. Every probe returns its default when the model cannot run the probe on meta (or
fake) tensors.
"""
from __future__ import annotations

import re

from memplan.inventory.activation import act_out_bytes, act_saves
from memplan.inventory.attention import eager_facts
from memplan.model.spec import NORM_CASES
from memplan.inventory.modules import BLOCK_PATH, block_module, block_norm, is_norm_module


def read(model, model_type: str, hidden: int, activation: str, body=None) -> dict:
    """Every fact this module reads, as memplan.model.spec.Arch fields, for the inventory of a model built on meta.

    `body` is the language model whose layers the facts are about (a composite model's; default the model itself);
    the loss is read from the head, peft's conversion from the whole model's type.
    """
    body = model if body is None else body
    return dict(**eager_facts(body), norm_saves=norm_saves(body, hidden),
                act_saves=act_saves(activation), act_out=act_out_bytes(activation),
                weightless_norms=weightless_norms(body), weightless_final_norms=weightless_final_norms(body),
                plain_cross_entropy=plain_cross_entropy(model), lora_expert_targets=peft_expert_targets(model_type),
                expert_gate_saves=expert_gate_saves(body), relative_bias_layers=relative_bias_layers(body),
                experts_dense=experts_dense(body), disentangled=disentangled(body))


def norm_saves(model, hidden: int) -> tuple[tuple[float, float, float], ...]:
    """What the model's normalisation layer saves for backward.

    It follows the installed code of any family: Llama's RMSNorm keeps an fp32 copy (4 bytes/element) plus the cast
    normalised tensor when the weight trains; T5's also its 16-bit input; Gemma's and OLMo2's apply the weight in
    fp32; Cohere's LayerNorm centres twice in fp32; OLMo's parameter-free LayerNorm upcasts first.

    Measured by running the norm once per NORM_CASES (16-bit or fp32 input and weights; weight frozen or trained) on
    meta tensors under torch.autograd.graph.saved_tensors_hooks. Saved tensors are told apart by storage, parameters
    left out; a tensor with the row dimension and `hidden` last counts per element, one with the row dimension and
    last dim 1 (LayerNorm's mean and rstd, RMSNorm's rsqrt) per row, a weight-sized one ([hidden]: Gemma's
    `1.0 + weight.float()`) not per token at all.

    Returns:
        Per case, (bytes per hidden element, bytes per row, bytes per element of the input itself among them);
        () when the model has no norm; on (), memplan.estimator.memory.saves falls back to LayerNorm's rule.
    """
    import copy

    import torch

    module = block_norm(model, hidden)
    if module is None:
        return ()
    out = []
    rows = 8
    for r, trains in NORM_CASES:
        mod = copy.deepcopy(module).to(torch.bfloat16 if r == 2 else torch.float32)
        params = {p.untyped_storage()._cdata for p in mod.parameters()}
        for p in mod.parameters():
            p.requires_grad_(trains)
        x = torch.empty(rows, hidden, device="meta", dtype=torch.bfloat16 if r == 2 else torch.float32,
                        requires_grad=True)
        saved: dict[int, tuple[int, tuple[int, ...]]] = {}

        def pack(t, saved=saved, params=params):
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = (t.untyped_storage().nbytes(), tuple(t.shape))
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                mod(x)
        except Exception:  # e.g. a norm that also takes the residual: LayerNorm's rule
            return ()
        per_row = [(n, shape) for n, shape in saved.values() if len(shape) > 1 and shape[0] == rows]
        own = saved.get(x.untyped_storage()._cdata, (0, ()))[0]
        out.append((sum(n for n, shape in per_row if shape[-1] == hidden) / (rows * hidden),
                    sum(n for n, shape in per_row if shape[-1] == 1) / rows, own / (rows * hidden)))
    return tuple(out)


def expert_gate_saves(model) -> tuple[float, ...]:
    """Bytes per element of the gated [tokens, I] output that a family's own expert gating function saves.

    GPT-OSS's `_apply_gate` clamps gate and up, then `gate * sigmoid(alpha * gate)` and `(up + 1) * glu` keep four
    [I] tensors beside the [tokens, 2I] input: 6 elements where SwiGLU's act(gate) * up keeps 3.

    Measured by running the experts' `_apply_gate` on fake tensors, for a 16-bit and an fp32 input.

    Returns:
        (16-bit, fp32), the input included; () for the standard SwiGLU (experts without `_apply_gate`).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    gate = next((m._apply_gate for m in model.modules() if "Experts" in type(m).__name__
                 and callable(getattr(m, "_apply_gate", None))), None)
    if gate is None:
        return ()
    rows, width, out = 8, 64, []
    for dtype in (torch.bfloat16, torch.float32):
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.empty(rows, 2 * width, dtype=dtype, requires_grad=True)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    gate(x)
        except Exception:  # the standard SwiGLU rule
            return ()
        out.append(sum(saved.values()) / (rows * width))
    return tuple(out)


class _Seen(Exception):
    pass  # raised by a hook once it has seen what it waits for


def experts_dense(model) -> bool:
    """Whether the model's MoE block hands its experts every token rather than each token's top-k.

    Llama-4's Llama4TextMoe runs `routed_in = hidden_states.repeat(num_experts, 1)` scaled by the router's scores,
    zero for unchosen experts, so each expert computes and saves every token; Mixtral and every grouped_mm family
    send each token to its top-k.

    Read by running the first MoE block on meta tensors until its experts module is called: the rows it receives
    per token decide.
    """
    import torch

    moe = next((m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)), None)
    if moe is None:
        return False
    width = next((p.shape[-1] for p in moe.parameters() if p.dim() == 2), None)
    rows = []

    def seen(module, args):
        rows.append(args[0].shape[0] if args and hasattr(args[0], "shape") else 0)
        raise _Seen

    handle = moe.experts.register_forward_pre_hook(seen)
    tokens = 24
    try:
        moe.to("meta")  # the inventory's model: its buffers (a router's score bias) are on the CPU
        with torch.no_grad():
            moe(torch.empty(1, tokens, width, device="meta"))
    except _Seen:
        pass
    except Exception:  # the routed rule
        return False
    finally:
        handle.remove()
    return bool(rows) and rows[0] > tokens


def relative_bias_layers(model) -> int:
    """Attention modules that own a learned relative position bias (`relative_attention_bias`): T5 and mT5 compute it
    once per stack (2), UMT5 in every self-attention layer. 0 for every other family."""
    return sum(1 for m in model.modules() if getattr(m, "relative_attention_bias", None) is not None)


def disentangled(model) -> tuple[int, int]:
    """DeBERTa-v2's disentangled attention (DisentangledSelfAttention with relative_attention): (its position
    terms, c2p and p2c, counted; the relative-embedding rows each layer projects, 2 x pos_ebd_size). (0, 0) for every
    other family."""
    for m in model.modules():
        if getattr(m, "relative_attention", False) and hasattr(m, "pos_ebd_size") and hasattr(m, "pos_att_type"):
            kinds = sum(k in ("c2p", "p2c") for k in (m.pos_att_type or ()))
            return kinds, 2 * int(m.pos_ebd_size) if kinds else 0
    return 0, 0


def weightless_norms(model) -> int:
    """Normalisation layers without parameters in the model's first block (OLMo's OlmoLayerNorm): the inventory
    counts norms by their weights (memplan.model.layout), so these add to every block."""
    block = block_module(model)
    if block is None:
        return 0
    return sum(1 for m in block.modules() if is_norm_module(m) and not any(True for _ in m.parameters(recurse=False)))


def weightless_final_norms(model) -> int:
    """Normalisation layers without parameters outside the blocks (OLMo's final OlmoLayerNorm): the inventory counts
    norms by their parameters, so these need a count of their own."""
    return sum(1 for name, m in model.named_modules() if not BLOCK_PATH.search(name) and "embed" not in name
               and is_norm_module(m) and not any(True for _ in m.parameters(recurse=False)))


def plain_cross_entropy(model) -> bool:
    """Whether the model's head computes its loss with torch's CrossEntropyLoss on the logits as they are.

    The alternative, `self.loss_function` (transformers loss/loss_utils.py), upcasts the logits to fp32 first.
    Plain: BERT and every encoder copied from it, T5, BART and the seq2seq families copied from it
    (`loss_fct = CrossEntropyLoss()`), DistilBERT (`self.mlm_loss_fct`).

    Read from the source of the head class's forward.
    """
    import inspect

    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source: the loss_function, the common case
        return False
    return "self.loss_function" not in source and bool(re.search(r"CrossEntropyLoss|cross_entropy\(|loss_fct", source))


def peft_expert_targets(model_type: str) -> tuple[str, ...]:
    """The LoRA target names peft moves onto a transformers-5 MoE family's fused expert tensors and router.

    peft (utils/transformers_weight_conversion.py `_convert_peft_config_moe`, peft 0.21) converts a family whose
    checkpoint conversion mapping exists and whose `_MODEL_TO_CONVERSION_PATTERN` base ("mixtral", "qwen2_moe") has
    target and fused-target mappings: all-linear and named targets then adapt the experts and the router instead of
    every Linear with an old name (a shared expert's or a dense block's gate_proj/up_proj/down_proj are left out).

    Read from the installed peft's mappings.

    Returns:
        "old:new" pairs (("down_proj:down_proj", "gate:gate.weight", "gate_proj:gate_up_proj",
        "up_proj:gate_up_proj") for the qwen2_moe pattern); () where peft converts nothing, or has no such module.
    """
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ModuleNotFoundError as e:  # an older peft: no conversion, no fused experts adapted
        if e.name != "peft.utils.transformers_weight_conversion":
            raise
        return ()
    base = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    mapping = conv._MOE_TARGET_MODULE_MAPPING.get(base)
    if (not mapping or not conv._MOE_FUSED_TARGETS.get(base)
            or conv.get_checkpoint_conversion_mapping(model_type) is None):
        return ()
    return tuple(sorted(f"{old}:{new}" for old, new in mapping.items()))
