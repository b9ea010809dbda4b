"""Token mixers other than softmax attention, measured when a model's inventory is built (memplan.inventory.build).

These are the layers a config's `layer_types` calls `linear_attention` (Qwen3-Next's and Qwen3.5's gated DeltaNet,
MiniMax's lightning attention). Their activations follow no attention rule: the gated DeltaNet's chunked recurrence
(transformers `torch_chunk_gated_delta_rule`, the path transformers runs without the flash-linear-attention kernels)
keeps fp32 copies of q, k, v, their chunked products and per-chunk states, far more per token than an attention
layer. Every probe returns its default when the mixer cannot run on fake tensors.
"""
from __future__ import annotations

from memplan.inventory.modules import block_module
from memplan.model.spec import LINEAR_CASES
from memplan.runtime.emulate.autocast import cuda_autocast_fp32
from memplan.runtime.steps import materialize
from memplan.runtime.tracker import StorageTracker, dispatch_mode

#: the names transformers gives a decoder layer's token mixer, in the order they are tried
_MIXERS = ("linear_attn", "self_attn", "attention", "mixer")


def linear_layers(config) -> tuple[int, ...]:
    """Decoder layers whose token mixer is a linear attention (config.layer_types)."""
    return tuple(i for i, t in enumerate(getattr(config, "layer_types", None) or ()) if t == "linear_attention")


def measure(model, layers: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Bytes per token the first linear-attention layer's token mixer saves for backward and works with in backward.

    Measured by running the mixer forward and backward on fake CPU tensors at 128 and 256 tokens and taking the
    slope (the chunked recurrence pads to 64 tokens and starts from a zero state, which the difference removes).
    Saves are read under torch.autograd.graph.saved_tensors_hooks, told apart by storage, with parameters and the
    Linears' inputs left out; the backward under memplan.runtime.tracker's storage accounting; the mixed case under
    CPU autocast with CUDA's fp32 op list (memplan.runtime.emulate.autocast.cuda_autocast_fp32).

    Returns:
        (saves, work), one value each per LINEAR_CASES entry:
        - saves: what the mixer saves beyond what its Linears save of their inputs (the block's rules count those:
          memplan.estimator.memory.activations);
        - work: what its backward holds beyond what is alive when its forward ends (its saves, output and the
          output's gradient): the gradients of its fp32 chunked products.
        ((), ()) where the model has no such layer; the estimate then names the layers as not modelled.
    """
    mixer = _mixer(model, layers)
    if mixer is None:
        return (), ()
    hidden = model.config.get_text_config().hidden_size
    try:
        per_case = [[_run(mixer, hidden, case, tokens) for tokens in (128, 256)] for case in LINEAR_CASES]
    except Exception:  # noqa: BLE001 - a mixer that needs more than hidden states, or has no fake kernel
        return (), ()
    saves = tuple((b[0] - a[0]) / 128 for a, b in per_case)
    work = tuple(max(b[1] - a[1], 0) / 128 for a, b in per_case)
    return saves, work


def _run(mixer, hidden: int, case: tuple, tokens: int) -> tuple[int, int]:
    """(bytes saved, bytes the backward holds beyond the forward's end) of one forward and backward of `mixer`."""
    import contextlib
    import copy

    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtypes, trains = case
    dtype = torch.bfloat16 if dtypes == 2 else torch.float32
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_fp32()) if dtypes == "mixed" else ()
    mod = copy.deepcopy(mixer).to(dtype)  # on meta, outside the fake mode (its _apply cannot swap there)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(mod, fake=True)
        for p in mod.parameters():
            p.requires_grad_(trains)
        skip = {p.untyped_storage()._cdata for p in mod.parameters()}
        kept: list = []  # every tensor keyed by its storage stays alive: no address is reused while measuring

        def note_input(module, args):
            if args and isinstance(args[0], torch.Tensor):
                kept.append(args[0])
                skip.add(args[0].untyped_storage()._cdata)

        hooks = [m.register_forward_pre_hook(note_input) for m in mod.modules() if isinstance(m, nn.Linear)]
        saved: dict[int, int] = {}

        def pack(t):
            kept.append(t)
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        tracker = StorageTracker()
        x = torch.empty(1, tokens, hidden, dtype=dtype, requires_grad=True)
        try:
            with dispatch_mode(tracker):
                tracker.phase = "forward"
                with contextlib.ExitStack() as stack:
                    for c in autocast:
                        stack.enter_context(c)
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        y = mod(x, **_required_none(mod))
                if isinstance(y, tuple):  # (output, weights): MiniMax's lightning attention
                    y = y[0]
                total = sum(n for k, n in saved.items() if k not in skip)
                kept.clear()  # the backward frees what the graph saved as it goes
                grad = torch.empty_like(y)
                end = tracker.current
                tracker.phase = "backward"
                y.backward(grad)
        finally:
            for h in hooks:
                h.remove()
    return total, tracker.phase_peaks.get("backward", end) - end


def _required_none(mod) -> dict:
    """None for every required argument of the mixer's forward after the hidden states (MiniMax's lightning
    attention takes position_embeddings and attention_mask, neither of which it needs without a cache)."""
    import inspect

    params = list(inspect.signature(mod.forward).parameters.values())[1:]
    return {p.name: None for p in params
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _mixer(model, layers: tuple[int, ...]):
    """The token mixer of the first linear-attention layer: its child named in _MIXERS."""
    block = block_module(model, layers[0]) if layers else None
    if block is None:
        return None
    return next((getattr(block, n) for n in _MIXERS if getattr(block, n, None) is not None), None)
