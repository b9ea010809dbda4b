"""The tracer's stand-ins for what CUDA does differently: sdpa's kernel choice and math kernel (memplan.runtime.emulate.sdpa),
autocast's cross-entropy (memplan.runtime.emulate.cuda)."""
from __future__ import annotations

import pytest
import torch

from memplan.runtime.emulate.sdpa import cuda_picks_math, cuda_sdpa, math_kernel


def _qkv(b=2, h=4, s=32, d=16, dtype=torch.float32, kv_heads=None, grad=True):
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, kv_heads or h, s, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, kv_heads or h, s, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def _permuted_bias(h=4, s=32, dtype=torch.float32):
    """T5's position bias before transformers 5.20: compute_bias returns values.permute([2, 0, 1]).unsqueeze(0)."""
    return torch.randn(s, s, h, dtype=dtype).permute([2, 0, 1]).unsqueeze(0)


def _saved(fn):
    """(shape, dtype) of every tensor autograd saves while fn() runs."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sorted(saved, key=str)


def test_cuda_falls_back_to_math_for_strided_masks_and_ungrouped_heads():
    """sdp_utils_cpp.h: every fused kernel needs stride 1 in the last dimension (mask included) and K/V with q's
    heads unless enable_gqa."""
    q, k, v = _qkv()
    assert cuda_picks_math(q, k, v, _permuted_bias(), False)
    assert not cuda_picks_math(q, k, v, _permuted_bias().contiguous(), False)
    assert not cuda_picks_math(q, k, v, None, False)
    assert not cuda_picks_math(q, k, v, torch.zeros(1, 1, 32, 1), False)  # a singleton last dimension
    q, k, v = _qkv(kv_heads=2, dtype=torch.bfloat16)
    assert cuda_picks_math(q, k, v, None, False)
    assert not cuda_picks_math(q, k, v, None, True)


def test_cuda_takes_grouped_kv_in_its_flash_kernel_only():
    """cuda/sdp_utils.cpp: enable_gqa reaches only the flash kernel (check_batch_size_and_num_heads_dense<true>), which
    runs fp16/bf16: fp32 grouped K/V fall back to the math kernel, unless autocast casts them (dtype)."""
    q, k, v = _qkv(kv_heads=2)
    assert cuda_picks_math(q, k, v, None, True)
    assert not cuda_picks_math(q, k, v, None, True, torch.bfloat16)
    sdpa = cuda_sdpa(torch.nn.functional.scaled_dot_product_attention)
    _, saved = _saved(lambda: sdpa(q, k, v, enable_gqa=True))
    assert ((2, 4, 32, 32), torch.float32) in saved  # the math kernel's fp32 probabilities
    assert ((8, 16, 32), torch.float32) in saved  # K repeated to every head (b x heads = 8, as the bmm sees it)


def test_dropout_keeps_grouped_kv_as_they_are():
    """With dropout the stand-in calls the CPU flash kernel itself; CUDA's flash kernel takes grouped K/V (enable_gqa),
    so they are saved at their own heads (santacoder's one K/V head: the trace held them at every head, -1.8%)."""
    sdpa = cuda_sdpa(torch.nn.functional.scaled_dot_product_attention)
    q, k, v = _qkv(kv_heads=1, dtype=torch.bfloat16)
    _, saved = _saved(lambda: sdpa(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True))
    assert ((2, 1, 32, 16), torch.bfloat16) in saved
    assert ((2, 4, 32, 16), torch.bfloat16) in saved  # q (and the output) at every head
    assert sum(shape == (2, 4, 32, 16) for shape, _ in saved) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_kernel_equals_torch_and_saves_what_it_saves(dtype):
    """Without dropout the stand-in is torch's composite math kernel: the same output and the same saved tensors
    (16-bit inputs upcast: fp32 q, k, v and scores)."""
    q, k, v = _qkv(dtype=dtype)
    mask = _permuted_bias(dtype=dtype)
    ours, ours_saved = _saved(lambda: math_kernel(q, k, v, mask))
    ref, ref_saved = _saved(lambda: torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0])
    torch.testing.assert_close(ours, ref)
    assert ours.dtype == dtype
    assert ours_saved == ref_saved
    assert ((2, 4, 32, 32), torch.float32) in ours_saved  # the fp32 softmax output, whatever the input dtype


def _peaks(fn, *inputs, safe_softmax_mask: bool = False) -> tuple[int, int]:
    """(forward, backward) peak live bytes above the inputs while fn runs under the tracer's storage accounting;
    safe_softmax_mask: each aten._safe_softmax the mode sees also makes the bool mask torch's composite makes inside
    it (test_safe_softmax_allocates_its_output_and_a_bool_mask), after its output."""
    from memplan.runtime.tracker import StorageTracker, dispatch_mode

    tracker = StorageTracker()
    tracker.phase = "forward"
    for t in inputs:
        tracker.serial_of(t)
    base = tracker.current

    def compute(func, args, kwargs):
        out = func(*args, **kwargs)
        if safe_softmax_mask and func is torch.ops.aten._safe_softmax.default:
            tracker.serial_of(out)
            masks = (torch.empty(out.shape, dtype=torch.bool), torch.empty((*out.shape[:-1], 1), dtype=torch.bool))
            for m in masks:
                tracker.serial_of(m)
        return out
    with dispatch_mode(tracker, compute):
        out = fn()
        if out.requires_grad:
            tracker.phase = "backward"
            out.sum().backward()
        del out
    return tracker.phase_peaks["forward"] - base, tracker.phase_peaks.get("backward", base) - base


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_math_kernel_holds_what_torchs_holds(causal, grad):
    """The stand-in keeps aten's tensors alive as long as attention.cpp names them: the fp32 upcast of q
    (query_acc) beside the scaled q to the end, and the cast-back weights (the second output: GCC builds the
    return's tuple right to left) through PV. T5's layout (transposed q/k/v, a permuted bias) in bf16; without
    them the trace of t5-base inference held 12 MiB less per call at b8 s512. aten's _safe_softmax is one op to the
    mode, as to the fake mode: its transient mask (next test) is added to torch's timeline."""
    q, k, v = (torch.randn(2, 64, 4, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(grad) for _ in "qkv")
    mask = None if causal else _permuted_bias(s=64, dtype=torch.bfloat16)
    ref = _peaks(lambda: torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, causal)[0],
                 q, k, v, mask, safe_softmax_mask=True)
    assert _peaks(lambda: math_kernel(q, k, v, mask, is_causal=causal), q, k, v, mask) == ref


def test_safe_softmax_allocates_its_output_and_a_bool_mask():
    """What the stand-in's _safe_softmax assumes of torch's composite (the same calls on CUDA): inside the op the
    softmax's output and a bool mask of the scores (isneginf), the rows' all(), and where() writes into the output
    (no second score-sized tensor). Real CPU tensors, torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 4, 64, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ops.aten._safe_softmax(x, -1)
    made = {e.name: e.cpu_memory_usage for e in prof.events() if e.name != "aten::_safe_softmax"}
    assert made["aten::softmax"] == x.nbytes
    assert made["aten::isneginf"] == x.numel()  # one byte per score
    assert made["aten::where"] == 0


def test_math_kernel_dropout_saves_cudas_bool_mask():
    """CUDA's at::dropout is native_dropout: a bool mask and the dropped fp32 probabilities are saved (the CPU's
    at::dropout would save a float noise tensor)."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    _, saved = _saved(lambda: math_kernel(q, k, v, _permuted_bias(dtype=torch.bfloat16), dropout_p=0.1))
    scores = [dt for shape, dt in saved if torch.Size(shape).numel() == 2 * 4 * 32 * 32]  # bmm saves 3-d views
    assert sorted(map(str, scores)) == ["torch.bool", "torch.float32", "torch.float32"]


def test_sdpa_stand_in_runs_math_under_autocast_for_a_permuted_fp32_bias():
    """Autocast casts q, k, v and the fp32 bias to bf16 (the cast keeps the permuted strides), then the math kernel
    runs outside autocast: fp32 scores are saved, where the flash path would save none."""
    sdpa = cuda_sdpa(torch.nn.functional.scaled_dot_product_attention)
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, saved = _saved(lambda: sdpa(q, k, v, attn_mask=_permuted_bias()))
        _, fused = _saved(lambda: sdpa(q, k, v, attn_mask=_permuted_bias().contiguous()))
    assert out.dtype == torch.bfloat16
    assert ((2, 4, 32, 32), torch.float32) in saved
    assert ((2, 4, 32, 32), torch.float32) not in fused


def test_cross_entropy_on_16_bit_logits_keeps_cudas_buffers():
    """CUDA autocast: log_softmax in the logits' own bf16 dtype, then nll_loss's fp32 cast, both saved; CPU autocast
    alone would cast the logits to fp32 and save an fp32 log_softmax only. Same loss value either way."""
    from memplan.runtime.emulate.autocast import cuda_autocast_fp32
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 50, (6,))
    target[0] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu, cpu_saved = _saved(lambda: torch.nn.functional.cross_entropy(logits, target))
        with cuda_autocast_fp32():
            cuda, cuda_saved = _saved(lambda: torch.nn.functional.cross_entropy(logits, target))
    torch.testing.assert_close(cuda, cpu, atol=2e-2, rtol=0)
    full = [dt for shape, dt in cuda_saved if shape == (6, 50)]
    assert sorted(map(str, full)) == ["torch.bfloat16", "torch.float32"]
    assert {dt for shape, dt in cpu_saved if shape == (6, 50)} == {torch.float32}  # log_softmax's, nll_loss reads it


def _traced_softmax_backward_peak(emulated: bool) -> int:
    """The tracer's peak (bytes) over a softmax's forward and backward on fake tensors, with or without cuda_like."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.runtime.emulate.cuda import cuda_like
    from memplan.runtime.tracker import StorageTracker, dispatch_mode

    tracker = StorageTracker()
    tracker.phase = "backward"  # the tracker counts peaks inside a step's phases only
    with FakeTensorMode(), dispatch_mode(tracker), (cuda_like() if emulated else contextlib.nullcontext()):
        x = torch.empty(2, 4, 64, 64, requires_grad=True)
        y = torch.softmax(x, -1)
        y.backward(torch.empty_like(y))
    return tracker.peak


def test_softmax_backward_holds_cudas_temporary():
    """CUDA's softmax backward first makes `tmp = grad * output` (aten/src/ATen/native/cuda/SoftMax.cu
    softmax_backward_cuda_out) beside its result; the CPU kernel makes none, so the tracer adds one gradient-sized
    tensor at that moment (found on an H100: Llama-2-7b LoRA bf16 eager b4 s1024 checkpointed held 0.56 GiB above
    the trace, one [4, 32, 1024, 1024] fp32 gradient)."""
    n = 2 * 4 * 64 * 64 * 4
    assert _traced_softmax_backward_peak(True) - _traced_softmax_backward_peak(False) == n
