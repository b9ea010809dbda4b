"""Build a ModelSpec from a config by instantiating the real transformers class on the meta device (lazy torch).

Counting, not guessing: every unique parameter of the real module tree is recorded with its shape and role
(accelerate `init_empty_weights` + `tie_weights()`, as accelerate's estimate-memory does).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from memplan.inventory import blocks as blockfacts, config as configfacts, kv_cache as cachefacts
from memplan.inventory import linear_attention as linfacts, probes as codefacts
from memplan.model.hf import (auto_class, check_flat, check_remote_code, check_uniform, is_composite, skipped_layers,
                                split_media, text_body)
from memplan.errors import BadInput
from memplan.model.layout import BLOCK_INDEX, slot
from memplan.model.spec import Arch, Buffer, Linear, ModelSpec, Param


def build_spec(config_dict: dict, model_id: str, config_file: str = "", trust_remote_code: bool = False,
               task: str | None = None) -> ModelSpec:
    """Instantiate `config_dict` on the meta device (the class of `task`, memplan.model.hf.TASKS, else the
    language-model head) and record its exact inventory."""
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
    check_uniform(config, config_file or model_id)
    cls = auto_class(config_dict, config, task)
    try:
        model = _on_meta(cls, config, trust_remote_code, torch, init_empty_weights)
    except ImportError as e:  # Gemma-3n's audio/vision towers need timm
        raise BadInput(f"{config_file or model_id}: building {cls.__name__} needs a package that is not installed: "
                       f"{e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise BadInput(f"{config_file or model_id}: transformers cannot build {cls.__name__} from this config: "
                       f"{type(e).__name__}: {e}") from None
    model.tie_weights()
    params, tied = _params(model, torch)
    params, tied, retie = _honour_untied_file(config_dict, model, params, tied)
    linears = _linears(model, torch)
    media, media_linears, extra = (), (), {}
    if is_composite(config):  # estimated for text-only steps: the vision tower and projector are held, never run
        last, skipped = params[-1].name.rsplit(".", 1)[0], skipped_layers(config)
        params, linears, media, media_linears, parts = split_media(model, params, linears, skipped)
        extra = {"last_module": last, "media_parts": parts, "skipped_layers": len(skipped)}
    arch = _arch(config.get_text_config(), config_dict, model, cls.__name__, linears, tied, **extra)
    if retie:
        arch = dataclasses.replace(arch, retie_on_resize=retie)
    return ModelSpec(model_id=model_id, arch=arch, params=tuple(params), linears=tuple(linears), tied=tuple(tied),
                     config_file=config_file, transformers_version=transformers.__version__,
                     buffers=tuple(_buffers(model)), media=media, media_linears=media_linears)


def _on_meta(cls, config, trust_remote_code: bool, torch, init_empty_weights):
    """`cls` built from `config` with no storage: under torch's meta device as well as init_empty_weights, since
    some classes fill tensors in __init__ (Llama-4's experts: torch.zeros(experts, hidden, 2 x expert width), 20 GiB
    of host memory per block for Maverick under init_empty_weights alone). A class whose __init__ reads values
    (which meta tensors lack) is built as accelerate builds it."""
    try:
        with init_empty_weights(), torch.device("meta"):
            return cls.from_config(config, trust_remote_code=trust_remote_code)
    except (RuntimeError, NotImplementedError):
        with init_empty_weights():
            return cls.from_config(config, trust_remote_code=trust_remote_code)


def _buffers(model) -> list[Buffer]:
    """Every registered buffer, persistent or not (both live on the device): floating ones are built in the
    model's dtype (from_config(dtype=...)), the others keep theirs."""
    return [Buffer(name, tuple(b.shape), "float" if b.is_floating_point() else str(b.dtype).removeprefix("torch."))
            for name, b in model.named_buffers()]


def _stack(name: str, model) -> str | None:
    if model.config.is_encoder_decoder:
        return "encoder" if "encoder." in name else ("decoder" if "decoder." in name else None)
    if BLOCK_INDEX.search(name) is None:
        return None
    return "encoder" if _is_encoder_only(model) else "decoder"


def _is_encoder_only(model) -> bool:
    """A bidirectional encoder: the masked-LM class, or a classification class of a family with one (BERT's; a
    decoder's classifier, LlamaForSequenceClassification, stays causal)."""
    import transformers as tf
    name = type(model).__name__
    encoder_family = type(model.config) in tf.AutoModelForMaskedLM._model_mapping
    return not model.config.is_encoder_decoder and not getattr(model.config, "is_decoder", False) and (
        "MaskedLM" in name or encoder_family and ("SequenceClassification" in name or "TokenClassification" in name))


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
    # a tied weight takes the input embedding's name, even where the head comes first (XLMRobertaForMaskedLM)
    emb = model.get_input_embeddings()
    canonical = {id(emb.weight): _module_name(model, emb) + ".weight"} if hasattr(emb, "weight") else {}
    seen, params, tied = {}, [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = kept = canonical.get(id(p), name)
            m = BLOCK_INDEX.search(kept)
            params.append(Param(kept, tuple(p.shape), _role(kept, owners[kept], model, torch),
                                int(m.group(1)) if m else None, _stack(kept, model)))
        if name != seen[id(p)]:
            tied.append((name, seen[id(p)]))
    return params, tied


def _honour_untied_file(d: dict, model, params, tied):
    """Untie the output embedding where the config file says tie_word_embeddings: false.

    transformers 5.23 ties T5/mT5 embeddings even then, but such a checkpoint ships a separate lm_head (flan-t5-xl,
    T0_3B, mt0-xxl: SOURCES.md), so tying would undercount by vocab x d_model. The file is followed.

    Returns:
        (params, tied, the tensor a resize ties that head to again: Arch.retie_on_resize, "" where nothing was
        untied).
    """
    if d.get("tie_word_embeddings", True) is not False:
        return params, tied, ""
    out = model.get_output_embeddings()
    head = next((alias for alias, target in tied if out is not None and alias.startswith(_module_name(model, out))), None)
    if head is None:
        return params, tied, ""
    target = dict(tied)[head]
    shape = next(p.shape for p in params if p.name == target)
    return params + [Param(head, shape, "lm_head")], [t for t in tied if t[0] != head], target


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
        m = BLOCK_INDEX.search(name + ".")
        rows.append(Linear(name, int(fin), int(fout), module.bias is not None, int(m.group(1)) if m else None,
                           _stack(name + ".", model), "conv1d" if kind == "Conv1D" else "linear",
                           module is out_emb))
    return rows


def _intermediate(config, linears, hidden: int) -> int:
    """Width of the MLP: the out_features of the first block's MLP input Linear (gate and up fused: half), else the
    config's intermediate size (fused MoE experts are not Linears)."""
    for m in linears:
        if m.block is not None and slot(m) == "mlp_in":
            return m.out_features // 2 if _fused_glu(config, m) else m.out_features
    return int(configfacts.first(config, "intermediate_size", "moe_intermediate_size", "n_inner", "d_ff", "ffn_dim",
                      default=4 * hidden))


def _fused_glu(config, m) -> bool:
    """One Linear computing gate and up together: Phi-3's gate_up_proj, or any MLP input twice the config's
    intermediate size (ModernBERT's Wi, chunked into input and gate)."""
    return m.short_name == "gate_up_proj" or m.out_features == 2 * (getattr(config, "intermediate_size", 0) or 0)


_GATED = {"gate_proj", "wi_0", "w1", "gate_up_proj"}


def _block_runs(linears, layers: int) -> int:
    """How often each parameter block runs in one forward.

    ALBERT's config asks for num_hidden_layers blocks but holds one layer whose parameters every block shares
    (modeling_albert.py AlbertTransformer: albert_layer_groups[int(i / (layers / groups))] for each of the layers),
    so the inventory sees one block that runs num_hidden_layers times (12).
    """
    per_stack: dict = {}
    for m in linears:
        if m.block is not None:
            per_stack.setdefault(m.stack, set()).add(m.block)
    found = max((len(v) for v in per_stack.values()), default=0)
    return layers // found if found and layers > found and layers % found == 0 else 1


def _norm_kind(body, hidden: int, norms: set[str]) -> str:
    """"rmsnorm" | "layernorm": whether the block's norm centres its input (inventory.blocks.norm_centres), else its class
    name (RMS*: rmsnorm)."""
    centres = blockfacts.norm_centres(body, hidden)
    if centres is None:
        return "rmsnorm" if any("RMS" in n for n in norms) else "layernorm"
    return "layernorm" if centres else "rmsnorm"


def _head_tied(model, tied) -> bool:
    """The output embedding shares the input embedding's weight (after _honour_untied_file: T5/mT5 checkpoints
    with their own lm_head are untied)."""
    out = model.get_output_embeddings()
    if out is None:
        return False
    head = _module_name(model, out) + ".weight"
    return any(alias == head for alias, _ in tied)


def _arch(config, d: dict, model, auto_class: str, linears, tied, skipped_layers: int = 0, **composite) -> Arch:
    """Architecture facts of `config` (a composite model's text config: its language model's facts, read from its
    modules; peft's defaults and the head from the whole model, as peft and the training step see it)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA_DEFAULTS

    hidden = int(configfacts.first(config, "hidden_size", "d_model", "n_embd"))
    heads = int(configfacts.first(config, "num_attention_heads", "num_heads", "n_head"))
    enc = model.config.is_encoder_decoder
    layers = int(configfacts.first(config, "num_hidden_layers", "num_layers", "n_layer")) - skipped_layers
    dec_layers = int(configfacts.first(config, "num_decoder_layers", "decoder_layers", default=layers)) if enc else layers
    kind = "seq2seq" if enc else ("encoder" if _is_encoder_only(model) else "causal")
    body = text_body(model) if composite else model
    norms = {type(m).__name__ for m in body.modules() if "Norm" in type(m).__name__}
    mla = configfacts.mla_dims(config)
    linear = linfacts.linear_layers(config)
    linear_saves, linear_work = linfacts.measure(body, linear)
    return Arch(
        kind=kind, model_type=config.model_type, auto_class=auto_class, hidden_size=hidden, num_heads=heads,
        num_kv_heads=heads if mla else configfacts.kv_heads(config, heads),
        head_dim=mla[0] if mla else int(configfacts.first(config, "head_dim", "d_kv", default=hidden // heads)),
        v_head_dim=mla[1] if mla else 0,
        intermediate_size=_intermediate(config, linears, hidden), vocab_size=model.get_input_embeddings().num_embeddings,
        num_encoder_layers=(int(configfacts.first(config, "encoder_layers", "num_layers", default=layers)) if enc else
                            (layers if kind == "encoder" else 0)),
        num_decoder_layers=dec_layers if kind != "encoder" else 0,
        mlp_gated=any(m.short_name in _GATED or m.block is not None and slot(m) == "mlp_in" and _fused_glu(config, m)
                      for m in linears)
        or bool(getattr(config, "is_gated_act", False))
        or bool(getattr(config, "num_local_experts", 0)),
        hidden_act=configfacts.activation(config),
        norm=_norm_kind(body, hidden, norms),
        max_positions=configfacts.max_positions(config),
        tie_word_embeddings=_head_tied(model, tied),
        num_experts=int(configfacts.first(config, "num_local_experts", "num_experts", default=0) or 0),
        experts_per_token=int(configfacts.first(config, "num_experts_per_tok", default=0) or 0),
        parallel_block=configfacts.parallel(config) or blockfacts.single_norm_block(body, hidden),
        post_norm=getattr(config, "do_layer_norm_before", True) is False or blockfacts.post_norm_blocks(model),
        attn_dropout=float(configfacts.first(config, "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                                  "dropout_rate", default=0.0) or 0.0),
        # Seed-OSS names its dropout of the attention and MLP outputs residual_dropout
        hidden_dropout=float(configfacts.first(config, "resid_pdrop", "hidden_dropout_prob", "hidden_dropout", "dropout",
                                    "dropout_rate", "residual_dropout", default=0.0) or 0.0),
        act_dropout=blockfacts.mlp_dropout(model, linears) or configfacts.act_dropout(config),
        router_copy=blockfacts.router_copy(body, hidden),
        residual_dropouts=blockfacts.residual_dropouts(body, hidden) or 0,
        attn_out_copy=blockfacts.attention_output_copied(body, hidden),
        embed_dropout=configfacts.first(config, "embd_pdrop"),  # None: the hidden dropout (stacks.embed_dropout)
        sliding_window=configfacts.first(config, "sliding_window"),
        final_logit_softcap=configfacts.first(config, "final_logit_softcapping"),
        attn_logit_softcap=configfacts.first(config, "attn_logit_softcapping"),
        mask_kinds=len(set(getattr(config, "layer_types", None) or ())) or 1,
        sliding_layers=configfacts.sliding_layers(config, dec_layers),
        unmodelled_layers=tuple(sorted(set(getattr(config, "layer_types", None) or ()) - configfacts.ATTENTION_LAYERS
                                       - ({"linear_attention"} if linear_saves else set()))),
        linear_layers=linear if linear_saves else (), linear_saves=linear_saves,
        indexer=(int(configfacts.first(config, "index_n_heads", default=0) or 0),
                 int(configfacts.first(config, "index_head_dim", default=0) or 0),
                 int(configfacts.first(config, "qk_rope_head_dim", default=0) or 0)),
        linear_work=linear_work,
        has_lm_head=model.get_output_embeddings() is not None,
        supports_sdpa=bool(getattr(model, "_supports_sdpa", False)),
        supports_flash=bool(getattr(model, "_supports_flash_attn", False)),
        supports_grad_ckpt=bool(getattr(model, "supports_gradient_checkpointing", True)),
        default_attn_impl="sdpa" if getattr(model, "_supports_sdpa", False) else "eager",
        lora_default_targets=tuple(LORA_DEFAULTS.get(model.config.model_type, ())),
        keep_in_fp32=tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ())),
        block_runs=_block_runs(linears, max(layers, dec_layers if enc else 0)),
        kv_cache_per_token=cachefacts.kv_cache_elems(model, kind),
        labels_disable_cache=cachefacts.labels_disable_cache(model),
        frozen_params=tuple(n for n, p in model.named_parameters() if not p.requires_grad),
        **codefacts.read(model, model.config.model_type, hidden, configfacts.activation(config), body), **composite,
    )
