"""What a usable config.json holds: the fields memplan reads to build a model, their types and ranges. A config
outside them (a string where a count goes, 0 layers, 100,000 layers, heads that do not divide the hidden size) is
refused with the field, its value and what is allowed, before transformers builds anything from it."""
from __future__ import annotations

import math

#: (names a family may use for the field, smallest, largest). The largest values are far past any released model
#: (Llama 3.1 405B: 126 layers, hidden 16,384, vocabulary 128,256) and keep a model build within seconds.
_HIDDEN = ("hidden_size", "d_model", "n_embd")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "multi_query_group_num")
_HEAD_DIM = ("head_dim", "d_kv")
_COUNTS = (
    (("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers"), 1, 1024),
    (_HIDDEN, 1, 2**20),
    (_HEADS, 1, 2**14),
    (_KV_HEADS, 1, 2**14),
    (("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim"), 1, 2**22),
    (("vocab_size",), 1, 2**24),
    (("max_position_embeddings", "n_positions", "n_ctx"), 1, 2**27),
    (_HEAD_DIM, 1, 2**14),
)
_FLAGS = ("tie_word_embeddings", "is_encoder_decoder")
#: torch dtype names a config may give as torch_dtype / dtype (torch's own spellings, and "auto")
_DTYPES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "uint8", "int16",
           "int32", "int64", "float8_e4m3fn", "float8_e5m2", "auto"}
#: sub-configs of composite models that describe a language model of their own
_SUBCONFIGS = ("text_config", "language_config", "llm_config")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count_problem(name: str, value, low: int, high: int) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if ok or value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and low <= value <= high:
        return None  # 4096.0: some exporters write counts as floats; transformers reads them as numbers
    return f"{name} must be a whole number from {low:,} to {high:,}, got {_shown(value)}"


def config_problems(d: dict, where: str = "") -> list[str]:
    """Every problem of a config.json's content (empty when usable), each naming its field."""
    p: list[str] = []
    at = f"{where}." if where else ""
    if not where and (not isinstance(d.get("model_type"), str) or not d.get("model_type")):
        p.append(f"model_type must be a non-empty string naming a transformers model type, got "
                 f"{_shown(d.get('model_type'))}")
    for names, low, high in _COUNTS:
        for name in names:
            problem = _count_problem(at + name, d.get(name), low, high) if name in d else None
            if problem:
                p.append(problem)
    for name in _FLAGS:
        if name in d and not isinstance(d[name], bool):
            p.append(f"{at}{name} must be true or false, got {_shown(d[name])}")
    for name in ("torch_dtype", "dtype"):
        value = d.get(name)
        if value is not None and (not isinstance(value, str) or value.removeprefix("torch.") not in _DTYPES):
            p.append(f"{at}{name} must be a torch dtype name ({', '.join(sorted(_DTYPES))}), got {_shown(value)}")
    if not p:
        p.extend(_shape_problems(d, at))
    for sub in _SUBCONFIGS:
        if isinstance(d.get(sub), dict):
            p.extend(config_problems(d[sub], at + sub))
    return p


def _first(d: dict, names: tuple[str, ...]):
    return next((d[n] for n in names if isinstance(d.get(n), int) and not isinstance(d.get(n), bool)), None)


def _shape_problems(d: dict, at: str) -> list[str]:
    """Heads that cannot split the hidden size, K/V heads that cannot group the query heads."""
    p: list[str] = []
    hidden, heads, kv = _first(d, _HIDDEN), _first(d, _HEADS), _first(d, _KV_HEADS)
    if hidden and heads and _first(d, _HEAD_DIM) is None and hidden % heads:
        p.append(f"{at}hidden_size {hidden:,} is not a multiple of num_attention_heads {heads:,} (and no head_dim "
                 "is given): every head must get the same width")
    if heads and kv and heads % kv:
        p.append(f"{at}num_key_value_heads {kv:,} does not divide num_attention_heads {heads:,}")
    return p
