"""TRL's activation offloading (SFTConfig / DPOConfig `activation_offloading`: trl/models/activation_offloading.py
OffloadActivations, as get_act_offloading_ctx_manager builds it: pinned host memory, a second stream, tensors of at
least 1 KiB, a forward stash of 5), as the device memory sees it, for the tracer and the validator.

What the algorithm keeps on the device (TRL 1.16):
- forward: each saved tensor of at least MIN_BYTES that is not a parameter is copied to host memory; the device copy
  stays referenced in the stash until STASH newer tensors were packed (the copy may still be in flight on the
  second stream). A non-contiguous tensor is first made contiguous (a device copy). A tensor whose storage is
  already in the stash, or a small one, stays referenced on the device until its backward.
- backward: a tensor still in the stash is used as is; any other is brought back to the device, and is dropped once
  the next autograd node has run (the previous node's tensors go when a node finishes, and the whole forward stash
  with them).
- the model's output head runs without offloading (a NoOp hooks pair around lm_head's forward); TRL's fused head
  reads lm_head.weight directly, so those hooks never fire there, as in TRL.
Streams and events order the copies; memory-wise the stand-in is synchronous. Lazy torch.
"""
from __future__ import annotations

import contextlib
import itertools

#: OffloadActivations' defaults that get_act_offloading_ctx_manager keeps
MIN_BYTES = 1024
STASH = 5


@contextlib.contextmanager
def offloading(model, tracker=None, host: str = "cpu"):
    """Saved tensors offloaded as TRL does, while the forward runs inside. tracker (memplan.runtime.tracker
    StorageTracker): the tracer's; the host copies are then born outside the device's count (its paged()), and saved
    tensors are marked as its pack hook marks them. host: the host device ("cpu")."""
    import torch

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple] = {}  # id -> (the device tensor kept, or None; its host copy, or None)
    keys: dict[tuple, int] = {}  # storage -> the id that packed it, while that id is in the stash
    key_of: dict[int, tuple] = {}
    stash: dict[int, object] = {}  # forward stash: id -> device tensor
    back: dict[int, object] = {}  # brought back in backward: id -> device tensor
    ids = itertools.count(1)
    node = {"current": None}

    def release(i: int) -> None:
        k = key_of.pop(i, None)
        if k is not None and keys.get(k) == i:
            del keys[k]

    def pack(t):
        if tracker is not None:
            s = tracker.serial_of(t)
            if s is not None:
                tracker.saved.add(s)
        i = next(ids)
        key = (t.untyped_storage()._cdata, t.storage_offset(), t.dtype)
        if key in keys or t.element_size() * t.nelement() < MIN_BYTES or isinstance(t, torch.nn.Parameter) \
                or t.untyped_storage()._cdata in params:
            saved[i] = (t, None)
            keys[key], key_of[i] = i, key
            return i
        if 0 not in t.stride() and (not t.is_contiguous() or t.storage_offset() != 0):
            t = t.clone(memory_format=torch.contiguous_format) if t.storage_offset() else t.contiguous()
        for j in [j for j in stash if j <= i - STASH]:
            del stash[j]
            release(j)
        with tracker.paged() if tracker is not None else contextlib.nullcontext():
            copy = torch.empty_like(t, device=host)
        saved[i] = (None, copy)
        stash[i] = t
        keys[key], key_of[i] = i, key
        return i

    def unpack(i: int):
        kept, copy = saved.pop(i)
        release(i)
        if copy is None:
            return kept
        current = torch._C._current_autograd_node()
        prev = []
        if current is not None and node["current"] is not current:
            node["current"], prev = current, list(back)
        if i in stash:
            t = stash[i]
        else:
            t = torch.empty_like(copy, device=model_device)
            back[i] = t

        def done(*_):
            stash.clear()
            for j in prev:
                back.pop(j, None)

        if current is not None:
            current.register_hook(done)
        return t

    model_device = next(model.parameters()).device
    noop = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    head = _output_head(model)
    handles = []
    if head is not None:
        handles = [head.register_forward_pre_hook(lambda *a: noop.__enter__()),
                   head.register_forward_hook(lambda *a: noop.__exit__(None, None, None), always_call=True)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for h in handles:
            h.remove()


def _output_head(model):
    """The module get_act_offloading_ctx_manager exempts: peft's base model unwrapped, its lm_head."""
    unwrapped = model.base_model if hasattr(model, "peft_config") and hasattr(model, "base_model") else model
    return getattr(unwrapped, "lm_head", None)
