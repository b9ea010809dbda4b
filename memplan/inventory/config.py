"""Architecture facts read from a model's config alone.

memplan.inventory.build builds Arch from these, the facts read from the model's code (probes, blocks) and the
instantiated module tree.
"""
from __future__ import annotations


def first(config, *names, default=None):
    """The value of the first of `names` the config sets (not None), else `default`."""
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def activation(config) -> str:
    """The MLP activation's ACT2FN name from the config, without a "gated-" prefix."""
    act = first(config, "hidden_act", "activation_function", "dense_act_fn", "hidden_activation", default="gelu")
    return str(act).removeprefix("gated-")


def parallel(config) -> bool:
    """Parallel attention and MLP where the config says so over two norms (Falcon's new decoder architecture, GPT-NeoX's
    use_parallel_residual); a block with one norm for both is read from the model (inventory.blocks.single_norm_block)."""
    mt = config.model_type
    if mt == "falcon":
        return bool(getattr(config, "parallel_attn", True) or getattr(config, "new_decoder_architecture", False))
    if mt == "gpt_neox":
        return bool(getattr(config, "use_parallel_residual", True))
    return False


#: config.layer_types values memplan models: attention over the whole sequence, a window or chunks; anything else
#: (linear_attention: Qwen3-Next's gated DeltaNet, MiniMax's lightning attention; conv: LFM2) is a token mixer the
#: attention rules do not cover (memplan.inventory.linear_attention measures linear_attention where it can)
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


def sliding_layers(config, layers: int) -> tuple[int, ...]:
    """Decoder layers that attend through the sliding window (Arch.sliding_layers), of `layers` decoder layers."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return tuple(range(layers)) if first(config, "sliding_window") else ()


def kv_heads(config, heads: int) -> int:
    """K/V heads as the attention holds them (Arch.num_kv_heads), which is not always the config's count.

    Multi-query attention (falcon-7b, gpt_bigcode) holds one. Falcon-40B/180B (new_decoder_architecture) hold K/V
    at every query head: FalconAttention._split_heads broadcasts each K/V group to its query heads and forward
    reshapes them to num_heads (modeling_falcon.py), so sdpa, the saved tensors and the cache see every head.
    """
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1  # falcon-7b / gpt_bigcode multi-query attention
    if config.model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        # Falcon-40B/180B: K/V broadcast to every query head (FalconAttention._split_heads)
        return heads
    return int(first(config, "num_key_value_heads", "num_kv_heads", default=heads) or heads)


def mla_dims(config) -> tuple[int, int] | None:
    """Head sizes of multi-head latent attention (MLA: DeepSeek-V2/V3, Mistral-4, Kimi; a config with kv_lora_rank).

    kv_b_proj expands the latent to every head, k = [k_nope, k_rope] at qk_nope_head_dim + qk_rope_head_dim and v
    at v_head_dim (modeling_deepseek_v2.py DeepseekV2Attention); these configs' head_dim is the rotary part alone.

    Returns:
        (query/key head size, value head size); None for any other attention.
    """
    if first(config, "kv_lora_rank") is None or first(config, "qk_nope_head_dim") is None:
        return None
    qk = int(config.qk_nope_head_dim) + int(first(config, "qk_rope_head_dim", default=0))
    return qk, int(first(config, "v_head_dim", default=qk))


def act_dropout(config) -> float:
    """Dropout on the MLP activation's output as BART-style configs name it (activation_dropout, applied functionally
    by the layer); an MLP's own Dropout module (T5's) is read from the model: inventory.blocks.mlp_dropout."""
    return float(first(config, "activation_dropout", default=0.0) or 0.0)


def max_positions(config) -> int | None:
    """Longest sequence the position scheme allows: learned/rotary tables set it; T5's relative buckets and
    BLOOM's ALiBi have no table (T5 configs carry a legacy n_positions=512 that nothing enforces)."""
    if config.model_type in ("t5", "mt5", "bloom"):
        return None
    return first(config, "max_position_embeddings", "n_positions")
