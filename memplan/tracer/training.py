"""Trace: run the real training step (transformers + peft + torch.optim) and record every storage's lifetime.

Ground truth without a GPU. The model is the real transformers class built from the config, LoRA is real peft,
checkpointing is transformers' own (non-reentrant torch.utils.checkpoint), the optimizer is torch's or
transformers' own. Tensors are fake (torch._subclasses.fake_tensor.FakeTensorMode on the "cpu" device: shapes and
dtypes, no data), or real for small models (fake=False) so tests can check the accounting against real tensors.

A TorchDispatchMode sees every op's outputs; each new storage is counted (rounded up to 512 B like the CUDA caching
allocator's smallest block, c10/cuda/CUDACachingAllocator.cpp kMinBlockSize) until a weakref callback reports its
release. The peak live bytes are recorded per phase (forward, backward, optimizer, zero_grad) over several steps,
with the bytes per category at the peak:
  weights          parameters and buffers (quantized storages included)
  gradients        .grad of trainable parameters
  optimizer_state  what the optimizer keeps between steps
  activations      saved for backward (autograd's saved-tensor hooks), or allocated in the forward and still alive
  temporaries      everything else alive at the peak (workspaces, casts, gradient intermediates)

Where the CPU's code path differs from CUDA's, the step runs CUDA's: memplan.runtime.emulate.cuda.EMULATIONS lists
each emulation.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

from memplan.errors import BadInput
from memplan.setup import TRL_TRAINERS, Setup, prompt_tokens, trainer_rows
from memplan.runtime.offload import STASH, offloading
from memplan.runtime.trl import add_head
from memplan.runtime.trl_step import generated_tokens, reference_model, trl_loop
from memplan.model.compat import attn_impl
from memplan.runtime.standins import StandInBnbOptimizer
from memplan.runtime.emulate.cuda import cuda_like
from memplan.runtime.allocator import need_and_replay
from memplan.runtime.tracker import CATEGORIES, StorageTracker, dispatch_mode, pack_hooks, watch_blocks
from memplan.runtime.steps import (build_model, cut_config, library_failures, make_optimizer, materialize,  # noqa: F401
                           no_eos, training_loop, TRAIN_PHASES)
from memplan.model.catalog import config_dict, load_spec, spec_for_task
from memplan.model.compat import check_setup
from memplan.tracer.apollo import apollo_answers
from memplan.tracer.inference import generation_answers, inference_trace

#: the tracer's phases: TRL's generation and reference passes (memplan.runtime.trl), then the step's
PHASES = ("generation", "reference_forward", "old_logps_forward") + TRAIN_PHASES


@dataclass
class TraceResult:
    """Peak live bytes of the traced step, per phase and per category at the peak. Sizes in bytes."""

    model: str
    setup: Setup
    peak_tensor_bytes: int  # live storages at the peak, each rounded up to the allocator's 512 B
    peak_phase: str
    components: dict[str, int]
    phases: dict[str, int]
    params_total: int
    params_trainable: int
    layers_traced: int | None = None
    layers_total: int | None = None
    paged_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    peak_reserved_bytes: int | None = None  # whole-model traces: the caching allocator's replay (memplan.runtime.allocator)
    allocator_need_bytes: int | None = None  # ... and the smallest allocator limit it fits under (allocator.min_limit)
    peak_allocated_bytes: int | None = None  # ... and torch.cuda.max_memory_allocated: whole blocks, workspaces

    def to_dict(self) -> dict:
        return {"model": self.model, "setup": self.setup.to_dict(), "components": dict(self.components),
                "phases": dict(self.phases), "peak_phase": self.peak_phase,
                "peak_tensor_bytes": self.peak_tensor_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "allocator_need_bytes": self.allocator_need_bytes,
                "device_total_bytes": None, "paged_optimizer_state": self.paged_bytes,
                "params_total": self.params_total, "params_trainable": self.params_trainable,
                "layers_traced": self.layers_traced, "layers_total": self.layers_total, "notes": list(self.notes)}


# ---------------------------------------------------------------------------------------------------- run

def run_traced(spec, setup: Setup, d: dict, layers: int | None, steps: int, fake: bool,
         on_step_end=None, tracker: StorageTracker | None = None, shard=None) -> StorageTracker:
    """One traced run. shard(model): applies data-parallel sharding to the meta model and returns a context the
    run happens in (memplan.tracer.sharded); the sharded model is then materialised with to_empty. An error raised
    inside torch/transformers/peft becomes TraceFailed: one message, not a traceback."""
    # RuntimeError from torch; AttributeError/TypeError from peft on a module it cannot wrap (peft's LoRA Linear on
    # PhiMoE's router, which returns a tuple)
    with library_failures(f"the traced training step of {spec.model_id}",
                          "Either a limit of the tracer (fake tensors on the CPU) or a failure the libraries would hit "
                          "on a GPU too (peft cannot wrap every module all-linear names)"):
        return _traced_run(spec, setup, d, layers, steps, fake, on_step_end, tracker, shard)


def _traced_run(spec, setup: Setup, d: dict, layers: int | None, steps: int, fake: bool,
                on_step_end=None, tracker: StorageTracker | None = None, shard=None) -> StorageTracker:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = tracker or StorageTracker()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    user, setup = setup, trainer_rows(setup, attn_impl(spec, setup))
    model = build_model(spec, setup, layers, d)
    ref = reference_model(spec, user, layers, d, build_model)
    if tracker.segmented:
        watch_blocks(model, tracker)
    sharded = shard(model) if shard else contextlib.nullcontext()
    answers = contextlib.nullcontext()
    if user.trainer == "grpo" and fake:
        answers = generation_answers(prompt_tokens(user) + generated_tokens(user))
        no_eos(model)
        if tracker.calls is not None:  # each call of the model: generate()'s prefill, then one per decode step
            generating = model.get_base_model() if hasattr(model, "get_base_model") else model
            generating.register_forward_pre_hook(
                lambda *_: tracker.calls.append(len(tracker.events)) if tracker.phase == "generation" else None)
    elif user.optimizer == "apollo-adamw" and fake:
        answers = apollo_answers()
    with sharded, fake_mode, answers, dispatch_mode(tracker), \
            cuda_like(setup.padded, spec.arch.kind == "seq2seq"):
        if shard:
            model.to_empty(device="cpu")
        else:
            materialize(model, fake)
        if ref is not None:  # TRL's second model for the reference, frozen, with a log-probs-only head
            materialize(ref, fake)
            add_head(ref, None)
        for m in (model, ref) if ref is not None else (model,):
            for p in m.parameters():
                tracker.tag(p, "weights")
            for b in m.buffers():  # quantization metadata of the stand-ins included
                tracker.tag(b, "weights")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(setup, params, standin_tracker=tracker, model=model)

        def enter(phase: str) -> None:
            tracker.phase, tracker.segment = phase, ("pre",)

        def tag_grads() -> None:  # tagged after the fact: touching .grad inside backward would change
            for p in params:  # AccumulateGrad's in-place decision
                tracker.tag(p.grad, "gradients")

        def tag_state() -> None:
            if hasattr(opt, "state") and not isinstance(opt, StandInBnbOptimizer):
                for st in opt.state.values():
                    for t in st.values():
                        tracker.tag(t, "optimizer_state")
            if on_step_end is not None:  # tests: compare the live bytes with the tensors really alive
                on_step_end(model, opt, tracker)

        saves = (functools.partial(offloading, model, tracker) if user.activation_offloading else
                 lambda: torch.autograd.graph.saved_tensors_hooks(pack_hooks(tracker), lambda t: t))
        hooks = dict(forward_ctx=saves, after_backward=tag_grads, after_step=tag_state)
        if user.trainer in TRL_TRAINERS:
            trl_loop(model, ref, opt, spec, user, setup, steps, "cpu", enter, **hooks)
        else:
            training_loop(model, opt, spec, setup, steps, "cpu", enter, **hooks)
        tracker.trainable = sum(p.numel() for p in params)
        tracker.total = sum(p.numel() for p in model.parameters())
    return tracker


def trace(model, setup: Setup | None = None, layers: int | None = None, steps: int = 2, fake: bool = True,
          **fields) -> TraceResult:
    """Trace `steps` training steps of `setup` on `model` (catalog id, config.json or ModelSpec).

    layers: trace the model cut to `layers` blocks and to `layers + 1`, and extrapolate every per-phase and
    per-category figure linearly to the full depth (the blocks are identical; stated in the result's notes).
    """

    setup = setup or Setup(**fields)
    spec = spec_for_task(load_spec(model), setup.task)
    total_layers = max(spec.arch.num_encoder_layers, spec.arch.num_decoder_layers)
    if setup.mode != "train":
        return _inference(spec, setup, layers, total_layers)
    if steps < 2:
        raise BadInput("trace needs at least 2 steps (the optimizer state exists from the second on)")
    check_setup(spec, setup)  # model-dependent setup problems, with their messages
    d = config_dict(spec)
    asked, layers = layers, layers and min_layers(setup, layers, spec)
    skipping = any(p[-1:].isdigit() for p in spec.arch.media_parts)  # layers a text-only step skips (Mllama)
    if not layers or layers >= total_layers - 1 or skipping:
        t = run_traced(spec, setup, d, None, steps, fake, tracker=StorageTracker(events=True))
        result = result_from(spec, setup, t, None, total_layers)
        _add_replay(result, t.events)
        if layers and skipping:  # cut traces would differ by a skipped layer's weights alone, not by a block
            result.notes.append(f"--layers {asked} ignored: the model skips some of its layers in text-only steps "
                                "({}), so its blocks differ; traced whole".format(
                                    ", ".join(p for p in spec.arch.media_parts if p[-1:].isdigit())))
        return result
    a, b = (run_traced(spec, setup, cut_config(d, n), n, steps, fake, tracker=StorageTracker(segmented=True))
            for n in (layers, layers + 1))
    result = extrapolate(spec, setup, a, b, layers, total_layers)
    if layers != asked:
        result.notes.append(f"--layers {asked} raised to {layers}: the traces need a block other than the first "
                            "(which may differ, as T5's computes the position bias) and past any that differ from the "
                            "rest (DeepSeek-V3's dense first blocks), with freeze a frozen block, and with activation "
                            "offloading more blocks than its 5-tensor stash")
    return result


def leading_irregular_blocks(spec) -> int:
    """How many blocks at the start of the depth differ in parameters from the blocks after them, whose
    parameters are all alike (DeepSeek-V3: its 3 dense blocks before 58 MoE ones; Llama-4-Maverick, alternating
    dense and MoE blocks: all but the last). A cut trace must reach past them: the extrapolation repeats the last
    traced block."""
    sizes: dict[tuple, int] = {}
    for p in spec.params:
        if p.block is not None:
            sizes[(p.stack, p.block)] = sizes.get((p.stack, p.block), 0) + p.numel
    irregular = 0
    for stack in {k[0] for k in sizes}:
        depth = [sizes[k] for k in sorted(k for k in sizes if k[0] == stack)]
        j = len(depth) - 1
        while j > 0 and depth[j - 1] == depth[-1]:
            j -= 1
        irregular = max(irregular, j)
    return irregular


def _inference(spec, setup: Setup, layers: int | None, total_layers: int) -> TraceResult:
    """validate's prefill and generate() traced whole on fake tensors (memplan.tracer.inference), and replayed."""
    check_setup(spec, setup)
    t = inference_trace(spec, setup)
    result = result_from(spec, setup, t, None, total_layers)
    _add_replay(result, t.events, "infer")
    if layers:
        result.notes.append(f"--layers {layers} ignored: inference is traced whole")
    return result


def _add_replay(result: TraceResult, events, mode: str = "train") -> None:
    """A whole-model trace's allocator figures (memplan.replay.need): the smallest cap it fits under, the uncapped
    reserved peak and max_memory_allocated as torch counts it (whole blocks)."""
    result.allocator_need_bytes, free = need_and_replay(events, mode)
    result.peak_reserved_bytes, result.peak_allocated_bytes = free.peak_reserved, free.peak_allocated


def min_layers(setup: Setup, layers: int, spec=None) -> int:
    """The fewest blocks to extrapolate from: 2, so that a block other than the first exists (the first may differ:
    T5's computes the position bias the others reuse); with `spec`, one past the blocks that differ from the rest
    (leading_irregular_blocks: DeepSeek-V3's dense first blocks); with freeze of N blocks, N + 1, so that the traced
    model has a frozen block (with fewer, every block it has trains); with activation offloading, one past its
    forward stash (memplan.runtime.offload.STASH), whose blocks' inputs stay on the device, so that each block more
    adds what a block adds in the whole model."""
    frozen = setup.trainable + 1 if setup.technique == "freeze" and isinstance(setup.trainable, int) else 0
    irregular = 1 + leading_irregular_blocks(spec) if spec is not None else 0
    stash = STASH + 1 if setup.activation_offloading else 0
    return max(layers, 2, frozen, irregular, stash)


def result_from(spec, setup, t: StorageTracker, traced, total) -> TraceResult:
    return TraceResult(model=spec.model_id, setup=setup, peak_tensor_bytes=t.peak, peak_phase=t.peak_phase,
                       components=t.breakdown(), phases=dict(t.phase_peaks), params_total=t.total,
                       params_trainable=t.trainable, layers_traced=traced, layers_total=total,
                       paged_bytes=t.excluded_bytes())


def extrapolate(spec, setup, a: StorageTracker, b: StorageTracker, n: int, total: int) -> TraceResult:
    """Every figure at `total` blocks from traces at n and n + 1: per phase, the largest of its segment classes'
    peaks, each extrapolated linearly (tracker: a class's peak is linear in the depth, a phase's is not), and of
    the phase's peak extrapolated (a lower bound of the truth when each event grows linearly)."""
    k = total - n

    def lin(x: int, y: int) -> int:
        return x + k * (y - x)

    segments = {key: lin(a.segment_peaks[key][0], b.segment_peaks[key][0])
                for key in a.segment_peaks.keys() & b.segment_peaks.keys()}
    phases = {p: max([v for (q, _), v in segments.items() if q == p]
                     + [lin(a.phase_peaks.get(p, 0), b.phase_peaks.get(p, 0))])
              for p in PHASES if p in a.phase_peaks}
    peak_phase = max(phases, key=phases.get)
    at = [key for key, v in segments.items() if key[0] == peak_phase and v == phases[peak_phase]]
    if at:
        ca, cb = (t.breakdown(t.segment_peaks[at[0]][1], peak_phase) for t in (a, b))
    else:
        ca, cb = a.breakdown(), b.breakdown()
    comps = {c: lin(ca[c], cb[c]) for c in CATEGORIES}
    note = (f"extrapolated: traced {n} and {n + 1} of {total} blocks; every figure = trace({n}) + {k} x "
            f"(trace({n + 1}) - trace({n})), per segment of each phase")
    where = _segment_words(at[0][1]) if at else "none of the segments tracked (its own peak, extrapolated)"
    note += f"; the peak is in the {peak_phase} at {where}"
    return TraceResult(model=spec.model_id, setup=setup, peak_tensor_bytes=phases[peak_phase],
                       peak_phase=peak_phase, components=comps, phases=phases,
                       params_total=lin(a.total, b.total), params_trainable=lin(a.trainable, b.trainable),
                       layers_traced=n, layers_total=total,
                       paged_bytes=lin(a.excluded_bytes(), b.excluded_bytes()), notes=[note])


def _segment_words(cls: tuple) -> str:
    if cls == ("pre",):
        return "its start, before the blocks"
    where, stack = cls[:2]
    return f"its end, past the blocks ({stack})" if where == "after" else f"the {where} block it processes ({stack})"


# ---------------------------------------------------------------------------------------------------- comparison

#: estimator component -> tracer category (logits, masks and autocast copies are forward-born: "activations")
ESTIMATE_CATEGORY = {
    "weights": "weights", "quant_state": "weights", "lora_adapters": "weights", "gradients": "gradients",
    "optimizer_state": "optimizer_state", "activations": "activations", "logits": "activations",
    "autocast_weight_copies": "activations", "attention_mask": "activations",
    "backward_temporaries": "temporaries", "forward_temporaries": "temporaries",
    "optimizer_temporaries": "temporaries",
    "dequant_temporaries": "temporaries", "dora_temporaries": "temporaries", "kv_cache": "activations", "forward_kv_cache": "temporaries",
}


def comparable_estimate_bytes(est) -> int:
    """The estimate's allocated peak without what only CUDA allocates (the cuBLAS workspace)."""
    return est.peak_allocated_bytes - est.components.get("cublas_workspace", 0)


def compare(result: TraceResult, est) -> dict:
    """Estimate vs trace: the peaks (relative error of the estimate) and the categories at each one's peak."""
    predicted = comparable_estimate_bytes(est)
    cats = dict.fromkeys(CATEGORIES, 0)
    for name, value in est.components.items():
        if name in ESTIMATE_CATEGORY:
            cats[ESTIMATE_CATEGORY[name]] += value
    return {"traced_peak_tensor_bytes": result.peak_tensor_bytes, "estimated_peak_tensor_bytes": predicted,
            "rel_error": (predicted - result.peak_tensor_bytes) / result.peak_tensor_bytes,
            "traced_peak_phase": result.peak_phase, "estimated_peak_phase": est.peak_phase,
            "estimated_peak_allocated_bytes": est.peak_allocated_bytes,
            "estimated_peak_reserved_bytes": est.peak_reserved_bytes,
            "estimated_allocator_need_bytes": est.allocator_need_bytes,
            "traced_components": dict(result.components), "estimated_components": cats}
