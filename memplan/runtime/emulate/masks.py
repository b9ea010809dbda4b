"""The tracer's answers to transformers' data-dependent mask checks (EMULATIONS["data-dependent checks"]).

A real run reads the attention mask's values to decide whether to build a mask at all: transformers 5 skips the
causal and the bidirectional mask under sdpa when no position is padded (masking_utils _ignore_causal_mask_sdpa,
_ignore_bidirectional_mask_sdpa; sdpa then gets is_causal, and grouped K/V pass through with enable_gqa), and 4.x
after `torch.all(mask == 1)`. Fake tensors have no values (masking_utils is_tracing is true for them, so every mask
would be built), so the tracer answers from the batch it made (steps.make_batch): masks derived from the input's
attention mask are all ones unless `Setup.padded`; a seq2seq decoder's own mask always is (collators pass no
decoder_attention_mask; BartDecoder and T5Stack make torch.ones). Lazy torch: nothing is imported at import.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def mask_checks(padded: bool = False, seq2seq: bool = False):
    """Within: fake padding masks count as all ones (unless padded; a seq2seq decoder's causal mask always), whole
    fake bool `torch.all` answers `not padded` (4.x), and a fake scalar `torch.rand([])` draws 1.0 (LayerDrop keeps
    every layer: `if dropout_probability < self.layerdrop`), and the largest of fake [rows, seq] integer ids is seq - 1
    (position ids). Real tensors run as they are."""
    try:
        from transformers import masking_utils as mu
    except ImportError:  # transformers < 4.53 has no masking_utils: only the torch.all answer applies
        mu = None
    saved = {}
    if mu is not None:
        for name, ones in (("_ignore_causal_mask_sdpa", not padded or seq2seq),
                           ("_ignore_bidirectional_mask_sdpa", not padded)):
            if hasattr(mu, name):
                saved[name] = getattr(mu, name)
                setattr(mu, name, _answering(saved[name], ones))
    try:
        with _torch_answers(all_true=not padded):
            yield
    finally:
        for name, fn in saved.items():
            setattr(mu, name, fn)


def _answering(original, all_ones: bool):
    """`original(padding_mask, ...)` as it runs on a real mask: a fake all-ones mask is passed as None (no padding),
    which keeps every other condition (sliding windows, query offsets) the function checks."""
    def check(padding_mask, *args, **kwargs):
        if all_ones and padding_mask is not None and is_fake(padding_mask):
            padding_mask = None
        return original(padding_mask, *args, **kwargs)
    return check


def _torch_answers(all_true: bool):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def faking() -> bool:
        return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if (func in (torch.all, torch.Tensor.all) and not kwargs and len(args) == 1
                    and is_fake(args[0]) and args[0].dtype == torch.bool):
                return torch.tensor(all_true)
            if func is torch.rand and not kwargs and args in (([],), ((),)) and faking():
                return torch.tensor(1.0)
            if (func is torch.max and not kwargs and len(args) == 1 and is_fake(args[0]) and args[0].dim() == 2
                    and not args[0].is_floating_point()):
                # the largest position id: the positions of a step's batch are arange(seq) per row, so seq - 1
                # (Phi-3's longrope under transformers 5.17 picks its frequencies from it:
                # modeling_rope_utils.longrope_frequency_update, `seq_len = torch.max(position_ids) + 1`)
                return torch.tensor(args[0].shape[-1] - 1)
            return func(*args, **(kwargs or {}))

    return _Mode()


def is_fake(t) -> bool:
    """A fake tensor (the tracer's): its values cannot be read."""
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)
