"""Facts about a model's blocks, read by running their modules (memplan.inventory.build).

Examples: the order an MLP runs its children in (its own Dropout between the projections), whether the norm centres,
what a MoE router saves for its weight's gradient. Like memplan.inventory.probes, they follow the installed
transformers and cover families no hand-kept list names.

Every probe returns its default when the model cannot run the probe on meta tensors.
"""
from __future__ import annotations

from memplan.inventory.modules import BLOCK_PATH, block_module, block_norm, is_norm_module
from memplan.model.layout import slot


def mlp_dropout(model, linears) -> float:
    """Dropout rate applied inside the MLP, between its input and output projections.

    Example: T5's `T5DenseActDense` / `T5DenseGatedActDense` (and every family copied from them) run `self.dropout`
    before `wo`. GPT-2's dropout after `c_proj` is the residual dropout and is not counted here.

    Read by running the module that holds the first block's output projection on meta tensors and recording the
    order its children run.

    Returns:
        The rate; 0.0 if there is none, or if the MLP cannot run on its hidden state alone (BART applies activation
        dropout functionally: inventory.config.act_dropout).
    """
    import torch
    from torch import nn

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
    """Whether the model's normalisation layer subtracts the mean (LayerNorm) or not (RMSNorm).

    T5's `T5LayerNorm` and every copy of it do not centre, whatever the class name says. Read by running the norm on
    the CPU with unit parameters: a centring norm gives the same output for x and x + 3.

    Returns:
        True or False; None where the norm does not run on its input alone (then memplan.inventory.build decides by
        the class name).
    """
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
    """Bytes per hidden element a MoE router saves for its weight's gradient as a copy of its own, from a 16-bit input.

    A transformers 5 router (a *Router module with an [experts, hidden] weight applied by F.linear) either saves its
    input itself (Qwen3-MoE, Mixtral, OLMoE: `F.linear(hidden_states, self.weight)`) or upcasts first and saves the
    fp32 copy (DeepSeek-V3, dots1: `F.linear(hidden_states.type(torch.float32), ...)`).

    Read by running the router once on meta tensors, without autocast, with its weight and input requiring grad.

    Returns:
        0.0 where it saves the input itself or there is no router; 4.0 where it upcasts first.
    """
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
    except Exception:  # taken to save the input itself
        return 0.0
    return sum(saved.values()) / (rows * hidden)


def single_norm_block(model, hidden: int) -> bool:
    """Whether a block normalises its input once for both its attention and its MLP, which then read one normed tensor.

    Parallel attention and MLP (GPT-J, Phi, CodeGen, Cohere, Cohere2) hold one hidden-size norm module per block;
    sequential blocks hold two or more (parameter-free ones counted). The model's second block is read, as the first
    may leave one out (ModernBERT's first attn_norm is an Identity).
    """
    block = block_module(model, 1) or block_module(model, 0)
    if block is None:
        return False
    norms = [m for m in block.modules() if is_norm_module(m)
             and all(tuple(p.shape) == (hidden,) for p in m.parameters(recurse=False))]
    return len(norms) == 1


class _Seen(Exception):
    """Raised by a spy once it has seen what it waits for."""


def attention_output_copied(model, hidden: int) -> bool:
    """Whether the fused attention kernel's output comes out heads-first, so that sdpa_attention_forward copies it.

    The copy is its `transpose(1, 2).contiguous()`, which a trained output projection saves beside the kernel's own
    output. The kernels lay their output out like q, and q reaches them as a new
    heads-first tensor where the attention concatenates a rotated part with the rest (GPT-NeoX, StableLM, Phi,
    Phi-3: `torch.cat((query_rot, query_pass))`) or MLA's parts (DeepSeek-V2/V3); Llama's elementwise rotation keeps
    the projection's sequence-first layout.

    Read by running the first block's attention on meta tensors up to the attention function, with a spy in place of
    sdpa's that reads q's layout.
    """
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
    """Whether the blocks normalise after each sublayer (post-LN).

    Post-LN families: BERT, BART, Marian, DeBERTa, ELECTRA, MPNet, DistilBERT. Both must hold: the first block runs
    a projection before any norm, and no norm follows the last block inside the base model (only embedding norms sit
    outside the blocks; a head's own norm, BERT's MLM transform, is outside the base model). OLMo2 runs its attention
    before a norm but ends with a final norm (its norms sit inside the residual branches); pre-LN stacks start with a
    norm.

    Read with forward pre-hooks on meta tensors: the first module called decides, so the call may stop there
    whatever the block needs next.
    """
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
    """How many hidden-size dropouts one block runs on its sublayers' outputs.

    BERT and GPT-2 run two; DistilBERT one, after its MLP alone. Counted by running the first block on meta tensors
    in training mode under a dispatch mode that sees each dropout of a [tokens, hidden] tensor.

    Returns:
        The count; None where the block has no dropout or does not run on its hidden state alone (the estimator
        then assumes two).
    """
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
    """The block's other required arguments, None each, so that it runs on its hidden state alone.

    Example: BART's and Marian's attention_mask and layer_head_mask.
    """
    import inspect

    params = list(inspect.signature(block.forward).parameters.values())[1:]
    return {p.name: None for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
