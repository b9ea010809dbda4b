"""Build a ModelSpec from a config by instantiating the real transformers class on the meta device (lazy torch).

Counting, not guessing: every unique parameter of the real module tree is recorded with its shape and role
(accelerate `init_empty_weights` + `tie_weights()`, as accelerate's estimate-memory does).
"""
from __future__ import annotations

import re
from pathlib import Path

from memplan import codefacts
from memplan.modelclass import auto_class, check_flat, check_remote_code
from memplan.errors import BadInput
from memplan.memory.layout import slot
from memplan.spec import Arch, Buffer, Linear, ModelSpec, Param

#: the names transformers gives a model's ModuleList of blocks (GPT-2 h, T5 block, BERT layer, Llama layers)
BLOCK_LISTS = "layers|layer|h|block|blocks"
_BLOCK_RE = re.compile(rf"\.(?:{BLOCK_LISTS})\.(\d+)\.")


def build_spec(config_dict: dict, model_id: str, config_file: str = "", trust_remote_code: bool = False) -> ModelSpec:
    """Instantiate `config_dict` on the meta device and record its exact inventory."""
    check_remote_code(config_dict, trust_remote_code)
    import torch
    import transformers
    from accelerate import init_empty_weights

    d = {k: v for k, v in config_dict.items() if k not in ("transformers_version", "_name_or_path")}
    try:
        if d.get("model_type") in transformers.CONFIG_MAPPING:
            config = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "auto_map"})
        else:
            config = transformers.AutoConfig.from_pretrained(str(Path(config_file).parent), trust_remote_code=True)
    except (TypeError, ValueError, KeyError) as e:
        raise BadInput(f"{config_file or model_id}: transformers rejects this config: {e}") from None
    check_flat(config, config_file or model_id)
    cls = auto_class(config_dict, config)
    with init_empty_weights():
        model = cls.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()
    params, tied = _params(model, torch)
    params, tied = _honour_untied_file(config_dict, model, params, tied)
    linears = _linears(model, torch)
    arch = _arch(config, config_dict, model, cls.__name__, linears, tied)
    return ModelSpec(model_id=model_id, arch=arch, params=tuple(params), linears=tuple(linears), tied=tuple(tied),
                     config_file=config_file, transformers_version=transformers.__version__,
                     buffers=_buffers(model))


def _buffers(model) -> list[Buffer]:
    """Every registered buffer, persistent or not (both live on the device): floating ones are built in the
    model's dtype (from_config(dtype=...)), the others keep theirs."""
    return [Buffer(name, tuple(b.shape), "float" if b.is_floating_point() else str(b.dtype).removeprefix("torch."))
            for name, b in model.named_buffers()]


def _stack(name: str, model) -> str | None:
    if model.config.is_encoder_decoder:
        return "encoder" if "encoder." in name else ("decoder" if "decoder." in name else None)
    if _BLOCK_RE.search(name) is None:
        return None
    return "encoder" if _is_encoder_only(model) else "decoder"


def _is_encoder_only(model) -> bool:
    return not model.config.is_encoder_decoder and not getattr(model.config, "is_decoder", False) and \
        "MaskedLM" in type(model).__name__


def _role(pname: str, module, model, torch) -> str:
    leaf = pname.rsplit(".", 1)[-1]
    kind = type(module).__name__
    if leaf == "bias":
        return "bias"
    if module is model.get_output_embeddings():
        return "lm_head"
    if isinstance(module, torch.nn.Embedding):
        return "embedding" if module is model.get_input_embeddings() else "pos_embedding"
    if "Norm" in kind:
        return "norm"
    if isinstance(module, torch.nn.Linear) or kind == "Conv1D":
        return "linear"
    return "expert" if "expert" in pname.lower() else "other"


def _params(model, torch):
    owners = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners.setdefault(f"{mname}.{pname}" if mname else pname, module)
    # a tied weight takes the input embedding's name, the head's is the alias, even where the head comes first
    # (XLMRobertaForMaskedLM: the head counted as untied and the tracer untied it, XLM-R-shaped bf16-mixed -23%)
    emb = model.get_input_embeddings()
    canonical = {id(emb.weight): _module_name(model, emb) + ".weight"} if hasattr(emb, "weight") else {}
    seen, params, tied = {}, [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = kept = canonical.get(id(p), name)
            m = _BLOCK_RE.search(kept)
            params.append(Param(kept, tuple(p.shape), _role(kept, owners[kept], model, torch),
                                int(m.group(1)) if m else None, _stack(kept, model)))
        if name != seen[id(p)]:
            tied.append((name, seen[id(p)]))
    return params, tied


def _honour_untied_file(d: dict, model, params, tied):
    """transformers 5.23 ties T5/mT5 embeddings even when the config file says tie_word_embeddings: false
    (SOURCES.md: flan-t5-xl, T0_3B, mt0-xxl would undercount by vocab x d_model). Follow the file: the checkpoint
    ships a separate lm_head."""
    if d.get("tie_word_embeddings", True) is not False:
        return params, tied
    out = model.get_output_embeddings()
    head = next((alias for alias, target in tied if out is not None and alias.startswith(_module_name(model, out))), None)
    if head is None:
        return params, tied
    target = dict(tied)[head]
    shape = next(p.shape for p in params if p.name == target)
    return params + [Param(head, shape, "lm_head")], [t for t in tied if t[0] != head]


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _linears(model, torch):
    out_emb = model.get_output_embeddings()
    rows = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not (isinstance(module, torch.nn.Linear) or kind == "Conv1D"):
            continue
        w = module.weight
        fin, fout = (w.shape[0], w.shape[1]) if kind == "Conv1D" else (w.shape[1], w.shape[0])
        m = _BLOCK_RE.search(name + ".")
        rows.append(Linear(name, int(fin), int(fout), module.bias is not None, int(m.group(1)) if m else None,
                           _stack(name + ".", model), "conv1d" if kind == "Conv1D" else "linear",
                           module is out_emb))
    return rows


def _first(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _intermediate(config, linears, hidden: int) -> int:
    """Width of the MLP: the out_features of the first block's MLP input Linear (gate and up fused: half), else the
    config's intermediate size (fused MoE experts are not Linears)."""
    for m in linears:
        if m.block is not None and slot(m) == "mlp_in":
            return m.out_features // 2 if _fused_glu(config, m) else m.out_features
    return int(_first(config, "intermediate_size", "moe_intermediate_size", "n_inner", "d_ff", "ffn_dim",
                      default=4 * hidden))


def _fused_glu(config, m) -> bool:
    """One Linear computing gate and up together: Phi-3's gate_up_proj, or any MLP input twice the config's
    intermediate size (ModernBERT's Wi, chunked into input and gate: taken for a plain MLP twice as wide, -4.8%)."""
    return m.short_name == "gate_up_proj" or m.out_features == 2 * (getattr(config, "intermediate_size", 0) or 0)


#: post-LN families (modeling_bert.py BertSelfOutput: LayerNorm(hidden + input); modeling_bart.py
#: BartEncoderLayer: self_attn_layer_norm after the residual add).
POST_NORM = {"bert", "bart", "roberta"}

_GATED = {"gate_proj", "wi_0", "w1", "gate_up_proj"}


def _activation(config) -> str:
    act = _first(config, "hidden_act", "activation_function", "dense_act_fn", "hidden_activation", default="gelu")
    return str(act).removeprefix("gated-")


def _parallel(config) -> bool:
    mt = config.model_type
    if mt == "falcon":
        return bool(getattr(config, "parallel_attn", True) or getattr(config, "new_decoder_architecture", False))
    if mt == "gpt_neox":
        return bool(getattr(config, "use_parallel_residual", True))
    return mt in ("phi", "gptj", "cohere")


#: config.layer_types values memplan models: attention over the whole sequence, a window or chunks; anything else
#: (linear_attention: Qwen3-Next's gated DeltaNet, MiniMax's lightning attention; conv: LFM2) is a token mixer whose
#: activations are not counted (a Qwen3-Next-shaped config traced 55% above the estimate)
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


def _sliding_layers(config, layers: int) -> tuple[int, ...]:
    """Decoder layers that attend through the sliding window (Arch.sliding_layers), of `layers` decoder layers."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return tuple(range(layers)) if _first(config, "sliding_window") else ()


def _kv_heads(config, heads: int) -> int:
    """K/V heads as the attention holds them (Arch.num_kv_heads)."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1  # falcon-7b / gpt_bigcode multi-query attention
    if config.model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        # Falcon-40B/180B: FalconAttention._split_heads broadcasts each K/V group to its query heads and forward
        # reshapes them to num_heads (modeling_falcon.py): sdpa, the saved tensors and the cache hold K/V at every
        # head. Tracer, a Falcon-40B config cut to 2 blocks, LoRA bf16 b2 s256: +5.7% when counted at 8 heads
        return heads
    return int(_first(config, "num_key_value_heads", "num_kv_heads", default=heads) or heads)


def _head_tied(model, tied) -> bool:
    """The output embedding shares the input embedding's weight (after _honour_untied_file: T5/mT5 checkpoints
    with their own lm_head are untied)."""
    out = model.get_output_embeddings()
    if out is None:
        return False
    head = _module_name(model, out) + ".weight"
    return any(alias == head for alias, _ in tied)


def _arch(config, d: dict, model, auto_class: str, linears, tied) -> Arch:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA_DEFAULTS

    hidden = int(_first(config, "hidden_size", "d_model", "n_embd"))
    heads = int(_first(config, "num_attention_heads", "num_heads", "n_head"))
    enc = model.config.is_encoder_decoder
    layers = int(_first(config, "num_hidden_layers", "num_layers", "n_layer"))
    dec_layers = int(_first(config, "num_decoder_layers", "decoder_layers", default=layers)) if enc else layers
    kind = "seq2seq" if enc else ("encoder" if _is_encoder_only(model) else "causal")
    norms = {type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__}
    return Arch(
        kind=kind, model_type=config.model_type, auto_class=auto_class, hidden_size=hidden, num_heads=heads,
        num_kv_heads=_kv_heads(config, heads), head_dim=int(_first(config, "head_dim", "d_kv", default=hidden // heads)),
        intermediate_size=_intermediate(config, linears, hidden), vocab_size=model.get_input_embeddings().num_embeddings,
        num_encoder_layers=(int(_first(config, "encoder_layers", "num_layers", default=layers)) if enc else
                            (layers if kind == "encoder" else 0)),
        num_decoder_layers=dec_layers if kind != "encoder" else 0,
        mlp_gated=any(m.short_name in _GATED or m.block is not None and slot(m) == "mlp_in" and _fused_glu(config, m)
                      for m in linears)
        or bool(getattr(config, "is_gated_act", False))
        or bool(getattr(config, "num_local_experts", 0)),
        hidden_act=_activation(config),
        norm="rmsnorm" if any("RMS" in n or n in ("T5LayerNorm", "MT5LayerNorm") for n in norms) else "layernorm",
        max_positions=_max_positions(config),
        tie_word_embeddings=_head_tied(model, tied),
        num_experts=int(_first(config, "num_local_experts", "num_experts", default=0) or 0),
        experts_per_token=int(_first(config, "num_experts_per_tok", default=0) or 0),
        parallel_block=_parallel(config),
        post_norm=config.model_type in POST_NORM or getattr(config, "do_layer_norm_before", True) is False,
        attn_dropout=float(_first(config, "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                                  "dropout_rate", default=0.0) or 0.0),
        hidden_dropout=float(_first(config, "resid_pdrop", "hidden_dropout_prob", "hidden_dropout", "dropout",
                                    "dropout_rate", default=0.0) or 0.0),
        act_dropout=_act_dropout(config),
        sliding_window=_first(config, "sliding_window"),
        final_logit_softcap=_first(config, "final_logit_softcapping"),
        attn_logit_softcap=_first(config, "attn_logit_softcapping"),
        mask_kinds=len(set(getattr(config, "layer_types", None) or ())) or 1,
        sliding_layers=_sliding_layers(config, dec_layers),
        unmodelled_layers=tuple(sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)),
        has_lm_head=model.get_output_embeddings() is not None,
        supports_sdpa=bool(getattr(model, "_supports_sdpa", False)),
        supports_flash=bool(getattr(model, "_supports_flash_attn", False)),
        default_attn_impl="sdpa" if getattr(model, "_supports_sdpa", False) else "eager",
        lora_default_targets=tuple(LORA_DEFAULTS.get(config.model_type, ())),
        keep_in_fp32=tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ())),
        **codefacts.read(model, config.model_type, hidden, _activation(config)),
    )


#: families whose MLP applies the model's one dropout rate between the activation and the output projection
#: (modeling_t5 T5DenseActDense / T5DenseGatedActDense: `hidden_states = self.dropout(hidden_states)` before `wo`)
MLP_DROPOUT_IS_DROPOUT_RATE = {"t5", "mt5"}


def _act_dropout(config) -> float:
    """Dropout on the MLP activation's output: BART-style configs name it activation_dropout; T5 reuses dropout_rate."""
    if config.model_type in MLP_DROPOUT_IS_DROPOUT_RATE:
        return float(getattr(config, "dropout_rate", 0.0) or 0.0)
    return float(_first(config, "activation_dropout", default=0.0) or 0.0)


def _max_positions(config) -> int | None:
    """Longest sequence the position scheme allows: learned/rotary tables set it; T5's relative buckets and
    BLOOM's ALiBi have no table (T5 configs carry a legacy n_positions=512 that nothing enforces)."""
    if config.model_type in ("t5", "mt5", "bloom"):
        return None
    return _first(config, "max_position_embeddings", "n_positions")
