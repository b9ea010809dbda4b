"""Facts about a model's blocks read by running their modules (memplan.inventory.build): the order an MLP runs its children
in (its own Dropout between the projections), whether the norm centres, what a MoE router saves for its weight's
gradient. Like memplan.inventory.probes, they follow the installed transformers and cover families no hand-kept list names."""
from __future__ import annotations

from memplan.inventory.modules import BLOCK_PATH, block_module, block_norm, is_norm_module


def mlp_dropout(model, linears) -> float:
    """The rate of a Dropout module the MLP runs between its first projection and its output projection (T5's
    T5DenseActDense / T5DenseGatedActDense: `self.dropout` before `wo`, in every family copied from it), found by
    running the module that holds the first block's output projection on meta and recording the order its children
    run in. GPT-2's MLP runs its Dropout after c_proj (the residual dropout, not this one). 0.0 where there is none or
    the module does not run on its hidden state alone (BART's layer applies activation_dropout functionally; its config
    names it: configfacts.act_dropout). A list of families ({t5, mt5}) missed UMT5's: a UMT5-shaped config, full bf16
    b2 s512, -1.9% (12 [b, s, d_ff] dropout masks)."""
    import torch
    from torch import nn

    from memplan.model.layout import slot

    out = next((m for m in linears if m.block == 0 and slot(m) == "mlp_out"), None)
    if out is None or "." not in out.name:
        return 0.0
    try:
        mlp = model.get_submodule(out.name.rsplit(".", 1)[0])
    except AttributeError:
        return 0.0
    order: list[nn.Module] = []
    handles = [child.register_forward_hook(lambda mod, *_: order.append(mod)) for child in mlp.children()]
    try:
        with torch.no_grad():
            mlp(torch.empty(1, 2, out.out_features, device="meta"))
    except Exception:  # needs more than its hidden state (a whole decoder layer): the config's rate
        return 0.0
    finally:
        for h in handles:
            h.remove()
    projection = mlp.get_submodule(out.short_name)
    last = order.index(projection) if projection in order else -1
    return max((m.p for m in order[1:last] if isinstance(m, nn.Dropout)), default=0.0)


def norm_centres(model, hidden: int) -> bool | None:
    """Whether the model's normalisation layer subtracts the mean (LayerNorm) or not (RMSNorm, T5's and every copy's
    *LayerNorm*): run on the CPU with unit parameters, a centring norm gives the same output for x and x + 3. None
    where the norm does not run on its input alone (the class name decides: memplan.inventory.build)."""
    import copy

    import torch

    module = block_norm(model, hidden)
    if module is None:
        return None
    try:
        mod = copy.deepcopy(module).to_empty(device="cpu").float()
        with torch.no_grad():
            for p in mod.parameters():
                p.fill_(1.0)
            x = torch.linspace(-2.0, 5.0, 2 * hidden).reshape(2, hidden)
            return bool(torch.allclose(mod(x), mod(x + 3.0), atol=1e-4))
    except Exception:
        return None


def router_copy(model, hidden: int) -> float:
    """Bytes per hidden element a MoE router module (a *Router with an [experts, hidden] weight applied by F.linear,
    transformers 5) saves for its weight's gradient as a copy of its own, given a 16-bit input without autocast: run
    once on meta with the weight and the input requiring grad. 0.0 where it saves the input itself (Qwen3-MoE, Mixtral,
    OLMoE: `F.linear(hidden_states, self.weight)`), 4.0 where it upcasts first (DeepSeek-V3, dots1:
    `F.linear(hidden_states.type(torch.float32), ...)`; found by the tracer: a DeepSeek-V3-shaped config, full bf16 b2
    s512, 2 MiB per block uncounted). 0.0 without a router or where it does not run on meta."""
    import copy

    import torch
    from torch import nn

    router = next((m for m in model.modules() if "router" in type(m).__name__.lower() and not isinstance(m, nn.Linear)
                   and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 2
                   and m.weight.shape[1] == hidden), None)
    if router is None:
        return 0.0
    rows = 8
    mod = copy.deepcopy(router).to(device="meta", dtype=torch.bfloat16)  # the inventory keeps buffers on the CPU
    mod.weight.requires_grad_(True)
    x = torch.empty(rows, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    own, params = x.untyped_storage()._cdata, {p.untyped_storage()._cdata for p in mod.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key != own and t.dim() == 2 and tuple(t.shape) == (rows, hidden):
            saved[key] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mod(x)
    except Exception:  # a router that needs more than its input: it saves the input itself
        return 0.0
    return sum(saved.values()) / (rows * hidden)


def single_norm_block(model, hidden: int) -> bool:
    """A block that normalises its input once for both its attention and its MLP, which then read one normed tensor
    (parallel attention and MLP: GPT-J, Phi, CodeGen, Cohere, Cohere2): one hidden-size norm module in the model's
    second block (the first may leave one out: ModernBERT's first attn_norm is an Identity); sequential blocks hold
    two or more (parameter-free ones counted). A list of families (phi, gptj, cohere) missed Cohere2: a Cohere2-shaped
    config LoRA q,v bf16 eager b2 s512 +1.4% with its first block's MLP counted (it records nothing there)."""
    block = block_module(model, 1) or block_module(model, 0)
    if block is None:
        return False
    norms = [m for m in block.modules() if is_norm_module(m)
             and all(tuple(p.shape) == (hidden,) for p in m.parameters(recurse=False))]
    return len(norms) == 1


class _Seen(Exception):
    """Raised by a spy once it has seen what it waits for."""


def attention_output_copied(model, hidden: int) -> bool:
    """Whether the fused kernel's output comes out heads-first, so that sdpa_attention_forward's
    `transpose(1, 2).contiguous()` copies it (a trained output projection then saves that copy beside the kernel's
    own): the kernels lay their output out like q, and q reaches them as a new heads-first tensor where the attention
    concatenates a rotated part with the rest (GPT-NeoX, StableLM, Phi, Phi-3: `torch.cat((query_rot, query_pass))`)
    or MLA's parts (DeepSeek-V2/V3), not where Llama's elementwise rotation keeps the projection's sequence-first
    layout. Read by running the first block's attention on meta up to the attention function (a spy in place of
    sdpa's, which reads q's layout); False where it does not run so. Found by the tracer: GPT-NeoX- and
    StableLM-shaped configs, full bf16 b2 s512 -0.8%, one [tokens, hidden] copy per block."""
    import copy

    import torch
    from transformers import modeling_utils

    block = block_module(model, 0)
    attn = next((m for m in block.modules() if "Attention" in type(m).__name__), None) if block is not None else None
    rotary = next((m for m in model.modules() if "Rotary" in type(m).__name__), None)
    functions = getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
    if attn is None or functions is None or "sdpa" not in functions:
        return False
    seen: dict[str, bool] = {}

    def spy(module, query, *args, **kwargs):
        seen["heads_first"] = query.is_contiguous()
        raise _Seen

    attn = copy.deepcopy(attn).to("meta")
    config = getattr(attn, "config", None)
    before, original = getattr(config, "_attn_implementation", None), functions["sdpa"]
    x = torch.empty(2, 3, hidden, device="meta")
    try:
        if config is not None:
            config._attn_implementation = "sdpa"
        functions["sdpa"] = spy
        positions = None
        if rotary is not None:
            positions = copy.deepcopy(rotary).to("meta")(x, torch.arange(3, device="meta").expand(2, 3))
        attn(hidden_states=x, attention_mask=None, position_embeddings=positions)
    except Exception:  # _Seen, or an attention that needs more than this
        pass
    finally:
        functions["sdpa"] = original
        if config is not None:
            config._attn_implementation = before
    return seen.get("heads_first", False)


def post_norm_blocks(model) -> bool:
    """The blocks normalise after each sublayer (post-LN: BERT, BART, Marian, DeBERTa, ELECTRA, MPNet, DistilBERT): the
    first block runs a projection before any norm, and no norm follows the last block inside the base model (only
    embedding norms outside the blocks; a head's own norm, BERT's MLM transform, is outside the base model). Both
    must hold: OLMo2 runs its attention before a norm but ends with a final norm (its norms sit inside the residual
    branches); pre-LN stacks start with a norm. The order is read with hooks on meta, the first call deciding
    (whatever the block then needs, the call may stop there). A list (bert, bart, roberta) missed Marian, XLM-R,
    DistilBERT, DeBERTa-v2, ELECTRA and MPNet: a Marian-shaped config LoRA bf16 -0.33%."""
    import torch

    base = getattr(model, "base_model", model)
    if any(is_norm_module(m) and not BLOCK_PATH.search(n) and "embed" not in n.lower()
           for n, m in base.named_modules()):
        return False  # a final norm: pre-LN
    block = block_module(model, 0)
    if block is None:
        return False
    first: list[str] = []

    def seen(kind):
        def hook(module, args):
            first.append(kind)
            raise _Seen
        return hook

    handles = [m.register_forward_pre_hook(seen("norm" if is_norm_module(m) else "linear")) for m in block.modules()
               if is_norm_module(m) or (type(m).__name__ in ("Linear", "Conv1D") and m is not block)]
    hidden = next((p.shape[-1] for m in block.modules() if is_norm_module(m) for p in m.parameters(recurse=False)),
                  None)
    try:
        block(torch.empty(1, 2, hidden or 8, device="meta"), **_other_arguments(block))
    except Exception:  # _Seen, or a block that needs more before its first module
        pass
    finally:
        for h in handles:
            h.remove()
    return first[:1] == ["linear"]


def residual_dropouts(model, hidden: int) -> int | None:
    """How many hidden-size dropouts one block runs (its sublayers' outputs: BERT's and GPT-2's two, DistilBERT's one,
    after its MLP alone), counted by running the first block on meta in training mode under a dispatch mode that sees
    each `native_dropout` of a [tokens, hidden] tensor. None where the block does not run on its hidden state alone
    (then two are assumed) or has no dropout. Found by the tracer: a DistilBERT-shaped config, +0.5 MiB per block
    at b2 s512 with two counted."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    block = block_module(model, 0)
    if block is None:
        return None
    tokens, count = 6, [0]
    dropouts = (torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # CUDA runs native_dropout; off CUDA dropout draws its mask with bernoulli_
            if func in dropouts and args[0].numel() == tokens * hidden:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    was = block.training
    try:
        block.train()
        with Count():
            block(torch.empty(1, tokens, hidden, device="meta"), **_other_arguments(block))
    except Exception:
        return None
    finally:
        block.train(was)
    return count[0] or None


def _other_arguments(block) -> dict:
    """The block's other required arguments, None each (BART's and Marian's attention_mask and layer_head_mask), so that
    it runs on its hidden state alone."""
    import inspect

    params = list(inspect.signature(block.forward).parameters.values())[1:]
    return {p.name: None for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
