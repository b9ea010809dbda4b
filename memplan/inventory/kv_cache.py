"""What a decoder's KV cache holds per token, measured by running its first attention layer on meta tensors when the
inventory is built (memplan.inventory.build).

The cache layout is the modeling code's choice and changes between releases (transformers 5.x DeepSeek-V2/V3 cache
MLA's compressed latent, kv_lora_rank + qk_rope_head_dim per token in one head; 4.x cached the keys and values
expanded to every head), so no formula over the config can know it. Every probe returns its default when the model
cannot run the probe on meta tensors. Lazy torch.
"""
from __future__ import annotations

import inspect
import re

#: tokens of the measuring forward (any count works: the cache grows by one row per token)
_TOKENS = 8


class _Seen(Exception):
    """Raised by the hook once the first attention layer has written the cache."""


def kv_cache_elems(model, kind: str) -> int:
    """Elements (keys + values) one decoder layer's cache holds per token.

    Measured on the first layer whose class is an attention: the decoder runs on meta tensors with a DynamicCache
    until that layer returns.

    Returns:
        The count; 0 where it is not measured (encoders, encoder-decoders, custom caches), and the caller falls back
        to 2 x kv_heads x head_dim.
    """
    if kind != "causal":
        return 0
    import torch

    try:
        from transformers import DynamicCache
    except ImportError:  # pragma: no cover - every supported transformers has it
        return 0
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    attn = next((m for m in decoder.modules() if type(m).__name__.endswith("Attention")
                 and any(True for _ in m.parameters())), None)
    if attn is None:
        return 0

    def seen(module, args, output):
        raise _Seen

    try:
        cache = DynamicCache(config=decoder.config)
    except TypeError:  # transformers 4.x: no config argument
        cache = DynamicCache()
    handle = attn.register_forward_hook(seen)
    params = inspect.signature(decoder.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    hidden = decoder.get_input_embeddings().embedding_dim
    try:
        decoder.to("meta")  # the inventory's model: its buffers (rotary inv_freq) are on the CPU
        with torch.no_grad():
            decoder(inputs_embeds=torch.empty(1, _TOKENS, hidden, device="meta"), use_cache=True, **{key: cache})
    except _Seen:
        pass
    except Exception:  # the caller's formula
        return 0
    finally:
        handle.remove()
    return _layer_elems(cache) // _TOKENS


def _layer_elems(cache) -> int:
    """Elements the cache's first layer holds (transformers 5: cache.layers[i].keys / .values; 4.x: key_cache /
    value_cache lists)."""
    layers = getattr(cache, "layers", None)
    if layers:
        first = layers[0]
        tensors = (getattr(first, "keys", None), getattr(first, "values", None))
    else:
        tensors = (getattr(cache, "key_cache", [None])[:1] or [None])[0], \
            (getattr(cache, "value_cache", [None])[:1] or [None])[0]
    return sum(t.numel() for t in tensors if t is not None and hasattr(t, "numel"))


def labels_disable_cache(model) -> bool:
    """Whether the head turns the cache off when it is given labels.

    A training step passes labels, so it then builds no DynamicCache (inference.training_cache_bytes). Example:
    modeling_bart.py BartForConditionalGeneration (`if labels is not None: ... use_cache = False`), copied by mBART,
    Marian, Pegasus, Blenderbot, PLBart...

    Read from the source of the head class's forward.
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return bool(re.search(r"if labels is not None:(?:\n[ \t]+[^\n]*){0,6}?\n[ \t]+use_cache = False", source))
