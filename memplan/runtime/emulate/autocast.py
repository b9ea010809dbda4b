"""CUDA autocast's cast policy, run on the CPU: the tracer's tensors are CPU (fake) tensors, so torch applies the
AutocastCPU policy, whose op lists differ from AutocastCUDA's. A torch-function mode, active while CPU autocast is
on, makes each op take CUDA's policy instead (lists from aten/src/ATen/autocast_mode.h and autocast_mode.cpp):

- the matmul family (AT_FORALL_LOWER_PRECISION_FP) is in both lists, but CUDA's also casts einsum, mv, addmv, addr,
  chain_matmul, linalg_multi_dot and the RNN cells to 16 bits: cast here (CUDA_LOWER_ONLY);
- CUDA runs AT_FORALL_FP32 (pow, exp, rsqrt, layer_norm, the losses, ...) in fp32, CPU autocast only some of them:
  16-bit arguments are cast up first (gelu_new's torch.pow saves fp32 copies);
- CUDA's AT_FORALL_FP32_SET_OPT_DTYPE (softmax, log_softmax, cumsum, cumprod, prod, sum, vector/matrix norms) and
  fp32_append_dtype (norm) compute a 16-bit input into an fp32 output (dtype=float32), without a cast copy;
- CUDA's AT_FORALL_PROMOTE (addcmul, addcdiv, atan2, cross, dot, scatter_add, ...) casts mixed floating arguments
  to the widest; CPU autocast runs them natively;
- CPU autocast's own promote list (cat, stack, index_copy) casts the narrower inputs to fp32 copies where CUDA's
  kernels promote natively (phi-2's and pythia's partial rotary: torch.cat of an fp32 rotated and a bf16 pass-
  through part), and its fp32 list holds ops CUDA leaves alone (view_as_complex, fft, linalg, 3-d pools): both
  run with CPU autocast off;
- cross_entropy: CPU autocast casts the 16-bit logits to fp32 first; CUDA has no entry for it and its
  decomposition takes a 16-bit log_softmax, cast up for nll_loss (_cuda_cross_entropy).

tests/test_cuda_parity.py checks each rule against the real AutocastCUDA kernels: torch registers them in
CPU-only builds too, and they run on fake CUDA tensors (no autograd) with CUDA autocast switched on directly.
"""
from __future__ import annotations

import contextlib

CUDA_LOWER_ONLY = {"einsum", "mv", "addmv", "addr", "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell",
                   "rnn_tanh_cell", "rnn_relu_cell"}
CUDA_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
             "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm",
             "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
             "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
             "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
             "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
             "cdist", "renorm", "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear"}
CUDA_FP32_DTYPE = {"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "linalg_vector_norm",
                   "linalg_matrix_norm", "norm"}
CUDA_PROMOTE = {"addcdiv", "addcmul", "atan2", "arctan2", "bilinear", "cross", "dot", "vdot",
                "grid_sample", "index_put", "tensordot", "scatter_add"}
CPU_ONLY = {"cat", "concat", "concatenate", "stack", "index_copy", "avg_pool3d", "polar", "quantile",
            "nanquantile", "stft", "trace", "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve",
            "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d",
            "adaptive_avg_pool3d", "adaptive_max_pool3d", "fractional_max_pool2d", "fractional_max_pool3d",
            "ctc_loss", "geqrf", "qr", "svd", "triangular_solve"}
CPU_ONLY_PREFIXES = ("fft_", "linalg_")  # CPU autocast's fp32 list holds the fft and most linalg functions
CPU_LOWER = {"linalg_vecdot"}  # in both lower-precision lists


def _half():
    import torch
    return (torch.bfloat16, torch.float16)


def _widest(dtypes):
    """torch.promote_types over floating dtypes, without dispatching an op (a dispatch mode would see it)."""
    import torch
    bits = {d: torch.finfo(d).bits for d in dtypes}
    top = max(bits.values())
    widest = [d for d in dict.fromkeys(dtypes) if bits[d] == top]
    return widest[0] if len(widest) == 1 else torch.float32  # bf16 with fp16


def cuda_autocast_fp32():
    """The torch-function mode applying CUDA autocast's policy while CPU autocast is on (module docstring)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten, tree_map_only

    half = _half()

    def cast(args, kwargs, f):  # f on every tensor argument, nested in lists and tuples too
        return tree_map_only(torch.Tensor, f, (args, kwargs))

    def up(t):
        return t.float() if t.dtype in half else t

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not torch.is_autocast_enabled("cpu"):
                return func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if name in CUDA_FP32:
                args, kwargs = cast(args, kwargs, up)
            elif name in CUDA_FP32_DTYPE:
                if (kwargs.get("dtype") is None and args and isinstance(args[0], torch.Tensor)
                        and args[0].dtype in half):
                    kwargs = {**kwargs, "dtype": torch.float32}
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **kwargs)
            elif name == "cross_entropy" and args and getattr(args[0], "dtype", None) in half:
                return _cuda_cross_entropy(*args, **kwargs)
            elif name in CUDA_LOWER_ONLY:
                low = torch.get_autocast_dtype("cpu")
                args, kwargs = cast(args, kwargs, lambda t: t.to(low) if t.dtype == torch.float32 else t)
            elif name in CUDA_PROMOTE:
                floats = [t.dtype for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.is_floating_point()]
                if len(set(floats)) > 1:
                    wide = _widest(floats)
                    args, kwargs = cast(args, kwargs, lambda t: t.to(wide) if t.is_floating_point() else t)
            elif name in CPU_ONLY or (name.startswith(CPU_ONLY_PREFIXES) and name not in CPU_LOWER):
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **kwargs)
            return func(*args, **kwargs)

    return _Mode()


def _cuda_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    """F.cross_entropy on 16-bit logits under CUDA autocast, which has no entry for cross_entropy_loss (the CPU's
    casts the logits to fp32 first): aten's decomposition (LossNLL.cpp cross_entropy_loss) takes log_softmax with
    dtype = the logits' own, which autocast's fp32_set_opt_dtype policy respects (16-bit log-probabilities, saved),
    then nll_loss, on autocast's fp32 list, casts them to fp32 (saved by its backward). Class-index targets
    without label smoothing only; anything else runs as the CPU would."""
    import torch
    import torch.nn.functional as F

    if label_smoothing or target.is_floating_point() or size_average is not None or reduce is not None:
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    with torch.autocast("cpu", enabled=False):
        logp = torch.log_softmax(input, dim=1 if input.dim() > 1 else 0, dtype=input.dtype)
        return F.nll_loss(logp.float(), target, None if weight is None else weight.float(),
                          ignore_index=ignore_index, reduction=reduction)


def checkpoint_kwargs() -> dict:
    """torch.utils.checkpoint arguments (non-reentrant, as Trainer's plan files set): the recompute re-enters the
    CPU emulation of CUDA autocast's policy (cuda_autocast_fp32), which the autograd engine does not carry into
    backward; otherwise recomputed values differ from the forward's and checkpoint raises. The mode only acts under
    CPU autocast: a no-op on the GPU."""
    import contextlib

    return {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), cuda_autocast_fp32())}


@contextlib.contextmanager
def autocast_switched_on(device: str, dtype):
    """Autocast for `device` switched on directly, as torch.autocast does it: torch.autocast("cuda") refuses
    without a GPU, but the AutocastCUDA kernels are registered in CPU-only builds too and apply to fake CUDA tensors -
    the reference tests/test_cuda_parity.py and benchmarks/autocast_check.py hold the emulation to."""
    import torch
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, False)
