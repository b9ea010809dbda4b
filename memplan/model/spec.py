"""ModelSpec: the exact parameter inventory of a model plus the architecture facts the estimator needs.

Pure data (no torch). Built once per model by `memplan.model.catalog` (real transformers class on the meta device)
and cached as JSON under memplan/data/models/inventory/, so a catalog lookup imports no torch.

Inventory JSON (version 1)::

    {"format": 1, "model_id": str, "config_file": str, "transformers_version": str,
     "arch": {<Arch fields>},
     "params":  [[name, shape, role, block, stack], ...],          # unique parameters only
     "linears": [[name, in, out, bias, block, stack, kind, is_output], ...],
     "tied":    [[alias_name, target_name], ...],                  # aliases not listed in params
     "buffers": [[name, shape, dtype], ...],                       # registered buffers (absent: none recorded)
     "media": [[name, shape, role, null, "media"], ...],            # a composite model's parts off the text path
     "media_linears": [[...as linears...], ...]}                    # (absent: none)

Roles: "embedding" (token embeddings), "pos_embedding" (learned positions, token types, relative-position
tables), "linear" (weight of an nn.Linear / GPT-2 Conv1D), "bias" (any bias), "norm" (LayerNorm/RMSNorm
weights), "lm_head" (untied output projection), "expert" (fused MoE expert weights), "other".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

INVENTORY_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Param:
    """One unique parameter tensor."""

    name: str
    shape: tuple[int, ...]
    role: str
    block: int | None = None  # index of the transformer block it belongs to
    stack: str | None = None  # "encoder" | "decoder" | None (outside the blocks)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Linear:
    """One nn.Linear (or transformers Conv1D) module: what LoRA targets and bitsandbytes quantizes."""

    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int
    bias: bool
    block: int | None = None
    stack: str | None = None
    kind: str = "linear"  # "linear" | "conv1d"
    is_output: bool = False  # the output embedding (lm_head): never LoRA'd by all-linear, never quantized
    rank_mult: int = 1  # LoRA rank multiplier (fused MoE experts: peft gives each expert its own rank-r slice)

    @property
    def short_name(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True, slots=True)
class Buffer:
    """One registered buffer: resident on the GPU beside the weights (GPT-BigCode's [n_positions, n_positions] bool
    causal mask, rotary inverse frequencies, BART's final_logits_bias)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name ("bool", "int64"); "float": built in the model's weight dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Arch:
    """Architecture facts read from the config and the instantiated model."""

    kind: str  # "causal" | "seq2seq" | "encoder"
    model_type: str
    auto_class: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # K/V heads as the attention holds them (inventory.config.kv_heads)
    head_dim: int  # query/key head size
    intermediate_size: int
    vocab_size: int  # rows of the input embedding as instantiated
    num_encoder_layers: int = 0
    num_decoder_layers: int = 0
    mlp_gated: bool = False  # SwiGLU/GeGLU: gate and up projections
    hidden_act: str = "gelu"
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    max_positions: int | None = None
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    parallel_block: bool = False  # attention and MLP read the same normed input (GPT-J/NeoX/Falcon/Phi)
    post_norm: bool = False  # LayerNorm after each residual add (BERT, BART, OPT-350m) instead of before
    attn_dropout: float = 0.0
    hidden_dropout: float = 0.0
    residual_dropouts: int = 0  # hidden-size dropouts per block (inventory.blocks.residual_dropouts); 0: two
    act_dropout: float = 0.0  # dropout on the MLP activation's output (BART's activation_dropout)
    labels_disable_cache: bool = False  # the head turns use_cache off when given labels (inventory.kv_cache)
    embed_dropout: float | None = None  # after the input embeddings (GPT-2 / Phi `embd_pdrop`); None: as hidden
    sliding_window: int | None = None
    #: decoder layers whose attention uses the window (config.layer_types' sliding_attention; every layer of a
    #: model with a window and no layer_types: Mistral, Phi-3)
    sliding_layers: tuple[int, ...] = ()
    #: Gemma2's soft-capping (config final_logit_softcapping / attn_logit_softcapping): cap * tanh(x / cap) on the
    #: logits and, in eager attention, on the scores; tanh saves its output for backward (modeling_gemma2.py)
    final_logit_softcap: float | None = None
    #: distinct attention masks the model builds per forward (config.layer_types: Gemma2's full and sliding)
    mask_kinds: int = 1
    attn_logit_softcap: float | None = None
    has_lm_head: bool = True  # a vocabulary-sized output head (MaskedLM/CausalLM/Seq2SeqLM)
    supports_sdpa: bool = True
    supports_flash: bool = False
    #: PreTrainedModel.supports_gradient_checkpointing (ALBERT: False, gradient_checkpointing_enable raises)
    supports_grad_ckpt: bool = True
    default_attn_impl: str = "sdpa"
    lora_default_targets: tuple[str, ...] = ()
    #: modules transformers keeps out of bitsandbytes quantization (and in fp32 when loading in fp16):
    #: PreTrainedModel._keep_in_fp32_modules, e.g. T5's "wo"
    keep_in_fp32: tuple[str, ...] = ()
    needs_remote_code: bool = False
    #: eager attention computes its softmax in fp32 and casts back (memplan.inventory.attention.eager_facts)
    eager_softmax_fp32: bool = False
    #: eager attention: (raw scores named through the softmax, masked sum named past it, probabilities cast back to
    #: q's dtype) (memplan.inventory.attention.eager_held; inventories with two values cast back)
    eager_held: tuple[bool, ...] = (False, False, True)
    #: each decoder layer returns its attention probabilities to the model's loop (attention.returns_attn_probs)
    returns_attn_probs: bool = False
    #: what the MLP activation saves per input element, per ACT_CASES (memplan.inventory.activation.act_saves)
    act_saves: tuple[float, ...] = ()
    #: bytes per element the MLP activation returns, per ACT_CASES (memplan.inventory.activation.act_out_bytes)
    act_out: tuple[float, ...] = ()
    #: parameter-free norm layers per block, and after the last block (inventory.probes.weightless_norms: OLMo's)
    weightless_norms: int = 0
    weightless_final_norms: int = 0
    #: the head's loss is torch CrossEntropyLoss on the logits as they are (inventory.probes.plain_cross_entropy)
    plain_cross_entropy: bool = False
    #: what the experts' own gating saves per gated element, 16-bit and fp32 (inventory.probes.expert_gate_saves: GPT-OSS)
    expert_gate_saves: tuple[float, ...] = ()
    #: bytes per hidden element a MoE router saves as its own copy of a 16-bit input (inventory.blocks.router_copy)
    router_copy: float = 0.0
    #: the fused attention kernel's output comes out heads-first and sdpa_attention_forward copies it, which a trained
    #: output projection saves (inventory.blocks.attention_output_copied: GPT-NeoX, StableLM, Phi-3, DeepSeek-V3)
    attn_out_copy: bool = False
    #: config.layer_types whose token mixer is not attention and is not modelled (inventory.config.ATTENTION_LAYERS)
    unmodelled_layers: tuple[str, ...] = ()
    #: DeepSeek-V3.2's lightning indexer in every attention: (heads, head size, rotary size) from config
    #: index_n_heads, index_head_dim and qk_rope_head_dim; (0, 0, 0) for every other family
    #: (forward_block.indexer_bytes; inventories from before the rotary size pad it with 0)
    indexer: tuple[int, ...] = (0, 0, 0)
    #: decoder layers whose token mixer is a linear attention (config.layer_types: Qwen3-Next's gated DeltaNet)
    linear_layers: tuple[int, ...] = ()
    #: bytes per token such a layer's mixer saves beyond its Linears' inputs, per LINEAR_CASES
    #: (inventory.linear_attention.measure, on fake tensors)
    linear_saves: tuple[float, ...] = ()
    #: bytes per token its backward holds beyond its saves, per LINEAR_CASES (inventory.linear_attention.measure)
    linear_work: tuple[float, ...] = ()
    #: attention modules owning a learned relative position bias (inventory.probes.relative_bias_layers: T5 2, UMT5 each)
    relative_bias_layers: int = 0
    #: DeBERTa-v2's disentangled attention: (position terms c2p/p2c, relative-embedding rows per layer), (0, 0) if
    #: none (inventory.probes.disentangled)
    disentangled: tuple[int, int] = (0, 0)
    #: what the norm layer saves, (bytes per element, bytes per row, bytes per element of its input itself) per
    #: NORM_CASES (inventory.probes.norm_saves; inventories built before the third was measured list two)
    norm_saves: tuple[tuple[float, ...], ...] = ()
    #: LoRA target names peft moves onto the fused experts and the router, "old:new" (inventory.probes.peft_expert_targets)
    lora_expert_targets: tuple[str, ...] = ()
    #: how often each parameter block runs in one forward (build._block_runs: ALBERT shares one layer's parameters
    #: across its num_hidden_layers blocks)
    block_runs: int = 1
    #: the MoE block runs every expert on every token, weighted by the router's scores (inventory.probes.experts_dense:
    #: Llama-4) instead of each token's top-k
    experts_dense: bool = False
    #: composite models (a vision-language model estimated for text-only steps): the module of the model's last
    #: parameter, which transformers keeps out of bitsandbytes quantization (get_keys_to_not_convert); "" = the
    #: module of ModelSpec.params[-1]
    last_module: str = ""
    #: composite models: the top-level parts the text-only step never runs (vision tower, projector), for the notes
    media_parts: tuple[str, ...] = ()
    #: value head size where it differs from head_dim (inventory.config.mla_dims: DeepSeek's MLA); 0 = head_dim
    v_head_dim: int = 0
    #: elements (keys + values) one decoder layer caches per token, measured (inventory.kv_cache.kv_cache_elems: MLA caches
    #: its latent); 0 = not measured, 2 x num_kv_heads x head_dim
    kv_cache_per_token: int = 0
    #: parameters the model builds with requires_grad=False (Marian's and Pegasus' sinusoidal position tables): no
    #: gradients or optimizer state in any technique
    frozen_params: tuple[str, ...] = ()
    #: the tensor a separate output embedding is tied to again when the vocabulary is resized: transformers 5 forces
    #: T5Config/MT5Config.tie_word_embeddings=True, from_pretrained keeps a checkpoint's own lm_head (flan-t5-xl,
    #: T0_3B, mt0-xxl), and resize_token_embeddings ends with tie_weights(), which ties it. "" elsewhere
    #: (memory.context._resized_spec)
    retie_on_resize: str = ""

    @property
    def num_layers(self) -> int:
        return self.num_encoder_layers + self.num_decoder_layers

    @property
    def kv_cache_elems(self) -> int:
        """Elements one decoder layer caches per token (keys + values)."""
        return self.kv_cache_per_token or 2 * self.num_kv_heads * self.head_dim

    @property
    def v_ratio(self) -> float:
        """Value (and attention output) head size over the query/key head size."""
        return self.v_head_dim / self.head_dim if self.v_head_dim else 1.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Exact parameter inventory + architecture of one model."""

    model_id: str
    arch: Arch
    params: tuple[Param, ...]
    linears: tuple[Linear, ...]
    tied: tuple[tuple[str, str], ...] = ()
    config_file: str = ""
    transformers_version: str = ""
    buffers: tuple[Buffer, ...] = ()
    #: a composite model's parameters and Linears outside its language model (vision tower, projector): resident,
    #: quantized and LoRA-wrapped like the rest, but a text-only step never runs them, so they get no gradients,
    #: optimizer state or activations (memplan.inventory.build.build_spec)
    media: tuple[Param, ...] = ()
    media_linears: tuple[Linear, ...] = ()
    #: a catalog variant (an -Instruct, -it or pre-quantized upload) answered from this base id's config
    variant_of: str = ""
    #: the bitsandbytes format a pre-quantized upload stores its weights in ("nf4"): a setup must load it so
    checkpoint_quant: str | None = None
    #: its quantization_config's group size (GPTQ, AWQ, torchao int4), where not 128
    checkpoint_group_size: int | None = None
    numel_total: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel_total", sum(p.numel for p in self.params) + sum(p.numel for p in self.media))

    @property
    def fused_experts(self) -> bool:
        """Its experts are fused [experts, out, in] tensors (transformers 5 MoE), not Linears: the stored formats
        memplan models quantize Linears only, so a quantized upload's experts are not modelled."""
        return any(p.role == "expert" and len(p.shape) == 3 for p in self.params)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        arch_keys = {f.name for f in fields(Arch)}
        arch = dict(d["arch"])
        arch["lora_default_targets"] = tuple(arch.get("lora_default_targets", ()))
        arch["keep_in_fp32"] = tuple(arch.get("keep_in_fp32", ()))
        arch["lora_expert_targets"] = tuple(arch.get("lora_expert_targets", ()))
        arch["norm_saves"] = tuple(tuple(pair) for pair in arch.get("norm_saves", ()))
        arch["act_saves"] = tuple(arch.get("act_saves", ()))
        arch["act_out"] = tuple(arch.get("act_out", ()))
        arch["eager_held"] = _padded(arch.get("eager_held", ()), (False, False, True))
        arch["unmodelled_layers"] = tuple(arch.get("unmodelled_layers", ()))
        arch["disentangled"] = tuple(arch.get("disentangled", (0, 0)))
        arch["linear_layers"] = tuple(arch.get("linear_layers", ()))
        arch["indexer"] = _padded(arch.get("indexer", ()), (0, 0, 0))
        arch["linear_saves"] = tuple(arch.get("linear_saves", ()))
        arch["linear_work"] = tuple(arch.get("linear_work", ()))
        arch["expert_gate_saves"] = tuple(arch.get("expert_gate_saves", ()))
        arch["sliding_layers"] = tuple(arch.get("sliding_layers", ()))
        arch["media_parts"] = tuple(arch.get("media_parts", ()))
        arch["frozen_params"] = tuple(arch.get("frozen_params", ()))
        return cls(
            model_id=d["model_id"],
            arch=Arch(**{k: v for k, v in arch.items() if k in arch_keys}),
            params=tuple(Param(n, tuple(s), r, b, st) for n, s, r, b, st in d["params"]),
            linears=tuple(Linear(*row) for row in d["linears"]),
            tied=tuple((a, t) for a, t in d.get("tied", ())),
            config_file=d.get("config_file", ""),
            transformers_version=d.get("transformers_version", ""),
            buffers=tuple(Buffer(n, tuple(s), dt) for n, s, dt in d.get("buffers", ())),
            media=tuple(Param(n, tuple(s), r, b, st) for n, s, r, b, st in d.get("media", ())),
            media_linears=tuple(Linear(*row) for row in d.get("media_linears", ())),
        )

    def to_dict(self) -> dict:
        arch = asdict(self.arch)
        arch["lora_default_targets"] = list(self.arch.lora_default_targets)
        arch["keep_in_fp32"] = list(self.arch.keep_in_fp32)
        arch["lora_expert_targets"] = list(self.arch.lora_expert_targets)
        arch["norm_saves"] = [list(pair) for pair in self.arch.norm_saves]
        arch["act_saves"] = list(self.arch.act_saves)
        arch["act_out"] = list(self.arch.act_out)
        arch["unmodelled_layers"] = list(self.arch.unmodelled_layers)
        arch["expert_gate_saves"] = list(self.arch.expert_gate_saves)
        arch["media_parts"] = list(self.arch.media_parts)
        arch["frozen_params"] = list(self.arch.frozen_params)
        out = {
            "format": INVENTORY_FORMAT,
            "model_id": self.model_id,
            "config_file": self.config_file,
            "transformers_version": self.transformers_version,
            "arch": arch,
            "params": [[p.name, list(p.shape), p.role, p.block, p.stack] for p in self.params],
            "linears": [[m.name, m.in_features, m.out_features, m.bias, m.block, m.stack, m.kind, m.is_output]
                        for m in self.linears],
            "tied": [list(t) for t in self.tied],
            "buffers": [[b.name, list(b.shape), b.dtype] for b in self.buffers],
        }
        if self.media or self.media_linears:
            out["media"] = [[p.name, list(p.shape), p.role, p.block, p.stack] for p in self.media]
            out["media_linears"] = [[m.name, m.in_features, m.out_features, m.bias, m.block, m.stack, m.kind,
                                     m.is_output] for m in self.media_linears]
        return out


def _padded(values, defaults: tuple) -> tuple:
    """An inventory's tuple field with the values later releases of memplan appended: the defaults past its length."""
    return tuple(values) + defaults[len(values):]


# Which entry of Arch's measured per-case tables (act_saves, norm_saves, linear_saves/linear_work) a setup reads.

#: (the activation's own parameters train, input dtype, under autocast) in the order Arch.act_saves lists them
ACT_CASES = tuple((trains, dtype, mixed) for trains in (False, True) for mixed in (False, True)
                  for dtype in ("bfloat16", "float32"))


def act_case(trains: bool, mixed: bool, input_bytes: int) -> int:
    """Index into Arch.act_saves (ACT_CASES order), computed: the estimator asks per block."""
    return 4 * trains + 2 * mixed + (input_bytes >= 4)


#: (residual stream bytes, weight trains) in the order Arch.norm_saves lists them
NORM_CASES = ((2, False), (2, True), (4, False), (4, True))


def norm_case(residual_bytes: int, trains: bool) -> int:
    """Index into Arch.norm_saves (NORM_CASES order)."""
    return 2 * (residual_bytes >= 4) + trains


#: (the layer's dtypes: 2 = bf16 input and weights, 4 = fp32, "mixed" = fp32 input and weights under bf16 autocast;
#: its parameters train), in the order Arch.linear_saves and Arch.linear_work list them
LINEAR_CASES = ((2, False), (2, True), (4, False), (4, True), ("mixed", False), ("mixed", True))


def linear_case(input_bytes: int, trains: bool, mixed: bool = False) -> int:
    """Index into Arch.linear_saves / linear_work (LINEAR_CASES) for the activations' bytes, whether the block trains
    and whether autocast runs (mixed precision, QLoRA)."""
    return LINEAR_CASES.index(("mixed" if mixed else 4 if input_bytes == 4 else 2, trains))
