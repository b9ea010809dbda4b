"""Which transformers class a config builds, and whether memplan can build it.

These are memplan.inventory.build's first steps.
"""
from __future__ import annotations

import re

from memplan.errors import BadInput
from memplan.model.layout import BLOCK_LIST_NAMES


#: --task: the Auto class a training script builds (transformers' names); None: the language-model head auto_class
#: picks from the config
TASKS = {"causal-lm": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM",
         "seq-cls": "AutoModelForSequenceClassification", "token-cls": "AutoModelForTokenClassification"}

#: the classes whose head is a small classifier over labels, not a vocabulary-sized LM head: class -> peft's task
#: type for it (SEQ_CLS / TOKEN_CLS also train the classifier: modules_to_save, a few KiB)
CLASSIFIER_CLASSES = {"AutoModelForSequenceClassification": "SEQ_CLS", "AutoModelForTokenClassification": "TOKEN_CLS"}


def auto_class(config_dict: dict, config, task: str | None = None):
    """The Auto class that builds the model: the task's (--task), else the config's architectures decide
    (ConditionalGeneration: seq2seq, MaskedLM/PreTraining: the encoder), else causal-LM first, except for a family
    with a masked-LM class. A composite vision-language config builds what users load it with,
    AutoModelForImageTextToText (Gemma-3: the same class as AutoModelForCausalLM; Llama-4 and Mllama map the causal
    class to their text model alone)."""
    import transformers as tf

    if task is not None:
        if task not in TASKS:
            raise BadInput(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        cls = getattr(tf, TASKS[task])
        if type(config) not in cls._model_mapping:
            raise BadInput(f"transformers has no {TASKS[task]} class for model type {config.model_type!r} "
                           f"(--task {task}); leave --task out for its language-model head")
        return cls

    arch = (config_dict.get("architectures") or [""])[0]
    order = [tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM]
    if is_composite(config):
        order = [tf.AutoModelForImageTextToText]
    elif "ConditionalGeneration" in arch or config.is_encoder_decoder:
        order = [tf.AutoModelForSeq2SeqLM] + order
    elif "MaskedLM" in arch or "PreTraining" in arch or (not arch or "CausalLM" not in arch and not getattr(
            config, "is_decoder", False)) and type(config) in tf.AutoModelForMaskedLM._model_mapping:
        # an encoder named by its bare or task class (BertModel: sentence-transformers; ...ForSequenceClassification)
        # or by none: its causal class is a decoder variant with a causal mask, which the checkpoint never runs
        order = [tf.AutoModelForMaskedLM] + order
    for cls in order + [tf.AutoModelForImageTextToText]:  # last: Mistral-4's flat config maps only there
        if type(config) in cls._model_mapping:
            return cls
    raise BadInput(f"transformers has no causal-LM, seq2seq-LM or masked-LM class for model type "
                   f"{config.model_type!r}; memplan supports decoder, encoder-decoder and encoder language models")


def _flat(config) -> bool:
    return any(getattr(config, k, None) is not None for k in ("hidden_size", "d_model", "n_embd"))


def is_composite(config) -> bool:
    """A vision-language config: a text_config and an image-text-to-text class (PaliGemma's and Mistral-4's also carry
    a hidden size of their own)."""
    import transformers as tf

    return (getattr(config, "text_config", None) is not None
            and type(config) in tf.AutoModelForImageTextToText._model_mapping)


def check_flat(config, name: str) -> None:
    """A config memplan can build: flat, or a vision-language model estimated for text-only steps (is_composite).
    Other composite configs (T5Gemma's encoder/decoder) have no hidden size of their own: say which part to pass
    instead of failing inside the inventory."""
    if _flat(config) or is_composite(config):
        return
    parts = [k for k in ("text_config", "encoder", "decoder", "vision_config") if getattr(config, k, None) is not None]
    raise BadInput(f"{name} is a composite config ({config.model_type}: {', '.join(parts) or 'sub-configs'}) without a "
                   "hidden size of its own; memplan estimates one language model per config. "
                   + ("Save its text_config as a config.json and pass that file."
                      if "text_config" in parts else "Pass the config of one of its language models."))


def check_uniform(config, name: str) -> None:
    """Refuse a heterogeneous config (transformers' per_layer_config: Gemma-4's global layers at head_dim 512 and
    their own K/V heads, beside sliding layers at 256): memplan models one attention shape for every layer, so it
    would under-count the wider layers. Raised before transformers' AmbiguousGlobalPerLayerAttributeError is."""
    text = config.get_text_config()
    if text.to_dict().get("per_layer_config"):  # the attribute itself is a view on every 5.23 config
        raise BadInput(f"{name}: {text.model_type} sets attention shapes per layer (config.per_layer_config), which "
                       "memplan does not model yet: an estimate would under-count its wider layers. Estimate a model "
                       "with one attention shape, or see docs/MODEL.md ('Families not modelled yet').")


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def text_body(model):
    """The language model inside a composite model (get_decoder: model.language_model, Idefics3's text_model)."""
    return model.get_decoder()


def check_remote_code(d: dict, trust_remote_code: bool) -> None:
    from transformers import CONFIG_MAPPING

    # transformers uses its own class when it knows the model_type, ignoring a legacy auto_map (phi-2 ships one)
    if d.get("model_type") not in CONFIG_MAPPING and not trust_remote_code:
        raise BadInput(f"model_type {d.get('model_type')!r} is not built into transformers: its code lives in the "
                       "model's repository; memplan never runs remote code unless you pass --trust-remote-code")


def skipped_layers(config) -> frozenset[int]:
    """Language-model layers a text-only step skips: Mllama's cross-attention layers (config.cross_attention_layers;
    modeling_mllama.py MllamaTextModel.forward: `if is_cross_attention_layer and cross_attention_states is None and
    is_cross_attention_cache_empty: continue`)."""
    return frozenset(getattr(config.get_text_config(), "cross_attention_layers", None) or ())


def split_media(model, params, linears, skipped: frozenset[int] = frozenset()):
    """A composite model's inventory split into its text path and its media parts.

    The text path is the language model and the output embedding; the media parts are the vision tower, the
    projector and the language-model layers a text-only step skips. Media entries lose their block index: their
    blocks are not run.

    Returns:
        (text params, text linears, media params, media linears, the top-level media module names).
    """
    from dataclasses import replace

    names = {m: n for n, m in model.named_modules()}
    text = (names[text_body(model)] + ".",) + ((names[model.get_output_embeddings()] + ".",)
                                                if model.get_output_embeddings() is not None else ())
    on_text = lambda x: (x.name + ".").startswith(text) and x.block not in skipped  # noqa: E731
    media = tuple(replace(p, block=None, stack="media") for p in params if not on_text(p))
    media_linears = tuple(replace(m, block=None, stack="media") for m in linears if not on_text(m))
    parts = tuple(sorted({_part(model, p.name) for p in media}))
    return [p for p in params if on_text(p)], [m for m in linears if on_text(m)], media, media_linears, parts


def _part(model, name: str) -> str:
    """The top-level module a media parameter belongs to: model.vision_tower, model.multi_modal_projector; a skipped
    language-model layer: model.language_model.layers.2."""
    layer = re.match(rf"(.*\.(?:{'|'.join(BLOCK_LIST_NAMES)})\.\d+)\.", name)
    if layer and layer.group(1).startswith(_module_name(model, text_body(model)) + "."):
        return layer.group(1)
    parts = name.split(".")
    inner = getattr(model, "base_model_prefix", "model")
    return ".".join(parts[:2]) if parts[0] == inner else parts[0]


def config_from_dict(d: dict, **overrides):
    """A transformers PretrainedConfig from config.json content (never remote code: auto_map is dropped)."""
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if k not in ("auto_map", "transformers_version")}
    d.update(overrides)
    return AutoConfig.for_model(**d)
