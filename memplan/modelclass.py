"""Which transformers class a config builds, and whether memplan can build it (memplan.inventory's first steps)."""
from __future__ import annotations

from memplan.errors import BadInput


def auto_class(config_dict: dict, config):
    """The Auto class that builds the model: the config's architectures decide (ConditionalGeneration: seq2seq,
    MaskedLM/PreTraining: the encoder), else causal-LM first, except for a family with a masked-LM class."""
    import transformers as tf

    arch = (config_dict.get("architectures") or [""])[0]
    order = [tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM]
    if "ConditionalGeneration" in arch or config.is_encoder_decoder:
        order = [tf.AutoModelForSeq2SeqLM] + order
    elif "MaskedLM" in arch or "PreTraining" in arch or not arch and type(config) in tf.AutoModelForMaskedLM._model_mapping:
        order = [tf.AutoModelForMaskedLM] + order  # with no architectures, its causal class is a decoder variant
    for cls in order:
        if type(config) in cls._model_mapping:
            return cls
    raise BadInput(f"transformers has no causal-LM, seq2seq-LM or masked-LM class for model type "
                   f"{config.model_type!r}; memplan supports decoder, encoder-decoder and encoder language models")


def check_flat(config, name: str) -> None:
    """A composite config (a vision-language model's text_config, T5Gemma's encoder/decoder) has no hidden size of
    its own: say which part memplan can estimate instead of failing inside the inventory."""
    if any(getattr(config, k, None) is not None for k in ("hidden_size", "d_model", "n_embd")):
        return
    parts = [k for k in ("text_config", "encoder", "decoder", "vision_config") if getattr(config, k, None) is not None]
    raise BadInput(f"{name} is a composite config ({config.model_type}: {', '.join(parts) or 'sub-configs'}) without a "
                   "hidden size of its own; memplan estimates one language model per config. "
                   + ("Save its text_config as a config.json and pass that file (the vision tower is then not counted)."
                      if "text_config" in parts else "Pass the config of one of its language models."))


def check_remote_code(d: dict, trust_remote_code: bool) -> None:
    from transformers import CONFIG_MAPPING

    # transformers uses its own class when it knows the model_type, ignoring a legacy auto_map (phi-2 ships one)
    if d.get("model_type") not in CONFIG_MAPPING and not trust_remote_code:
        raise BadInput(f"model_type {d.get('model_type')!r} is not built into transformers: its code lives in the "
                       "model's repository; memplan never runs remote code unless you pass --trust-remote-code")
