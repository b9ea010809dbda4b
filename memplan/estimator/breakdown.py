"""estimate(): sum the memory/* components over the phases of a training step (or of inference).

Pure given the ModelSpec: no torch, no printing. Phase model (steady state, step >= 2, when optimizer state exists;
torchtitan's estimation script: "iter 0 does not have optimizer state"): each phase is a dict component -> bytes
alive at that phase's high-water mark; the allocated peak is the largest phase, and `components` shows that phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memplan import libs
from memplan.estimator.memory import distributed as dist
from memplan.estimator.memory import logits as lg
from memplan.estimator.memory import optimizer as opt
from memplan.estimator.memory import offload, overhead, weights
from memplan.estimator.memory.context import Ctx, mxfp4_dequantized, resolve, reties_head
from memplan.estimator.phases import inference_phases, sharded_phases, training_phases
from memplan.estimator import trainers
from memplan.setup import TRL_TRAINERS, Setup, sharding_label
from memplan.model.spec import ModelSpec
from memplan.gpus import assume_gpu
from memplan.model.catalog import load_spec, spec_for_task

#: display order of components; device-only terms last.
COMPONENTS = ("weights", "quant_state", "lora_adapters", "reference_model", "gradients", "optimizer_state", "optimizer_temporaries",
              "gathered_params", "comm_buffers", "activations", "autocast_weight_copies", "logits", "attention_mask",
              "dequant_temporaries", "dora_temporaries", "forward_temporaries", "backward_temporaries", "forward_kv_cache", "kv_cache", "reference_forward",
              "cublas_workspace", "allocator_reserve", "vllm_colocated",
              "paged_optimizer_state", "nccl_buffers", "cuda_context")
_DEVICE_ONLY = ("allocator_reserve", "vllm_colocated", "paged_optimizer_state", "nccl_buffers", "cuda_context")
_PERSISTENT = ("weights", "quant_state", "lora_adapters", "reference_model", "optimizer_state", "cublas_workspace", "kv_cache",
               "comm_buffers")


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted memory of one Setup on one model. All sizes in bytes.

    components: name -> bytes alive at the allocated peak (plus the device-only terms), in COMPONENTS order.
    phases: phase name -> peak allocated bytes in that phase.
    """

    model: str
    setup: Setup
    params_total: int
    params_trainable: int
    components: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    notes: tuple[str, ...] = field(default=())
    largest_block_bytes: int = 0  # the largest single tensor (memory.logits.largest_block_bytes)
    cap_fragmentation_bytes: int = 0  # split cache a capped allocator cannot free (overhead.cap_fragmentation_bytes)
    host_bytes: int = 0  # pinned CPU memory per GPU process (offloaded state); x num_gpus per node

    @property
    def allocator_need_bytes(self) -> int:
        """What an allocator cap must allow for the step not to OOM: the live peak, a fresh block for the
        largest tensor and, with checkpointing, the split cache the allocator cannot free. The cached-but-free rest
        of the reserved peak is released and retried under a cap (docs/PLANNER.md, data/measured/planner-check*.csv)."""
        return self.peak_allocated_bytes + self.largest_block_bytes + self.cap_fragmentation_bytes

    @property
    def cap_need_bytes(self) -> int:
        """allocator_need_bytes plus the device-only memory outside the caching allocator (CUDA context, paged
        optimizer state, NCCL): what the GPU's memory must hold."""
        return self.allocator_need_bytes + self.device_total_bytes - self.peak_reserved_bytes

    def summary(self) -> dict:
        """One flat row: the model, the setup's fields, the peaks and each component (bytes)."""
        return {"model": self.model, **self.setup.to_dict(), "peak_phase": self.peak_phase,
                "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "device_total_bytes": self.device_total_bytes, "need_bytes": self.cap_need_bytes,
                **{f"{name}_bytes": value for name, value in self.components.items()}}

    def _repr_html_(self) -> str:
        """A notebook shows the peaks and the components table."""
        from html import escape
        head = (f"<b>{escape(self.model)}</b>: peak allocated {self.peak_allocated_bytes / 2**30:.2f} GiB "
                f"({escape(self.peak_phase)}), reserved {self.peak_reserved_bytes / 2**30:.2f} GiB, device total "
                f"{self.device_total_bytes / 2**30:.2f} GiB")
        frame = self.to_frame()
        return head + frame[frame["bytes"] > 0].to_html(index=False, float_format=lambda v: f"{v:.3f}")

    def to_frame(self):
        """The components at the peak as a pandas DataFrame: bytes, GiB and share of the device total."""
        import pandas as pd
        df = pd.DataFrame({"component": list(self.components), "bytes": list(self.components.values())})
        df["GiB"] = df["bytes"] / 2**30
        df["share_of_device"] = df["bytes"] / self.device_total_bytes
        return df

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "params_total": self.params_total,
            "params_trainable": self.params_trainable,
            "setup": self.setup.to_dict(),
            "components": dict(self.components),
            "phases": dict(self.phases),
            "peak_phase": self.peak_phase,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "allocator_need_bytes": self.allocator_need_bytes,
            "cap_fragmentation_bytes": self.cap_fragmentation_bytes,
            "need_bytes": self.cap_need_bytes,
            "host_bytes_per_gpu": self.host_bytes,
            "host_bytes_per_node": self.host_bytes * self.setup.num_gpus,
            "notes": list(self.notes),
        }


def estimate(model: str | ModelSpec, setup: Setup | None = None, **fields) -> Estimate:
    """Estimate GPU memory of `setup` (or Setup(**fields)) on `model`: a catalog id, a config.json path or a ModelSpec."""
    if isinstance(model, ModelSpec):
        spec = model
    else:
        spec = load_spec(model)
    if setup is None:
        setup = Setup(**fields)
    elif fields:
        raise TypeError("pass either a Setup or Setup fields, not both")
    spec = spec_for_task(spec, setup.task)
    if setup.trainer in TRL_TRAINERS:
        ctx = resolve(spec, trainers.rows_setup(spec, setup))
        return _assemble(ctx, trainers.trl_phases(ctx), setup=setup)
    ctx = resolve(spec, setup)
    if dist.is_distributed(setup):
        return _assemble(ctx, *sharded_phases(ctx, dist.compute_ctx(spec, setup)))
    phases = training_phases(ctx) if setup.mode == "train" else inference_phases(ctx)
    return _assemble(ctx, phases)


def estimator_for(gpu):
    """estimate() as for `gpu` (its architecture sets the cuBLAS workspace: memory.overhead); fit, plan and doctor
    estimate through it for the card they plan for."""

    def run(model, setup: Setup | None = None, **fields) -> Estimate:
        with assume_gpu(gpu):
            return estimate(model, setup, **fields)
    return run


def _assemble(ctx: Ctx, phases: dict[str, dict[str, int]], rank: dist.RankState | None = None,
              setup: Setup | None = None) -> Estimate:
    """The Estimate of `phases`; `setup`: the user's, where ctx was resolved on the rows a trainer runs."""
    setup = setup or ctx.setup
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    peak = totals[peak_phase]
    at_peak = phases[peak_phase]
    transient = peak - sum(v for k, v in at_peak.items() if k in _PERSISTENT)
    reserve = overhead.allocator_reserve_bytes(ctx, transient)
    paged = opt.optimizer_state_bytes(ctx) if ctx.training and opt.is_paged(ctx) else 0
    nccl = rank.nccl_device_bytes if rank else 0
    vllm = trainers.vllm_bytes(setup) or 0
    device_only = {"allocator_reserve": reserve, "vllm_colocated": vllm, "paged_optimizer_state": paged,
                   "nccl_buffers": nccl, "cuda_context": overhead.CUDA_CONTEXT_BYTES}
    merged = {**at_peak, **device_only}
    components = {k: int(merged.get(k, 0)) for k in COMPONENTS}
    return Estimate(
        model=ctx.spec.model_id, setup=setup, params_total=weights.total_numel(ctx),
        params_trainable=weights.trainable_numel(ctx) if ctx.training else 0,
        components=components, phases={k: int(v) for k, v in totals.items()}, peak_phase=peak_phase,
        peak_allocated_bytes=int(peak), peak_reserved_bytes=int(peak + reserve),
        device_total_bytes=int(peak + reserve + vllm + paged + nccl + overhead.CUDA_CONTEXT_BYTES),
        notes=_notes(ctx, setup), largest_block_bytes=lg.largest_block_bytes(ctx),
        cap_fragmentation_bytes=overhead.cap_fragmentation_bytes(ctx, int(at_peak.get("activations", 0))),
        host_bytes=(rank.host_bytes if rank else 0) + offload.host_bytes(ctx))


def _notes(ctx: Ctx, setup: Setup) -> tuple[str, ...]:
    notes = [f"attention: {ctx.attn_impl}"]
    if setup.trainer in TRL_TRAINERS:
        notes.extend(trainers.notes(ctx, setup))
    if ctx.setup.mode == "train" or ctx.setup.padded:
        notes.append("batches: padded (sdpa keeps a mask per layer)" if ctx.setup.padded else
                     "batches: no padding (packed or equal-length; --padded for a padding collator's)")
    release = libs.version("transformers")
    if release:  # the code paths that differ between releases follow it (memplan.libs; docs/MODEL.md)
        notes.append("transformers " + libs.dotted(release))
    if dist.is_distributed(ctx.setup):
        notes.append(f"per GPU: {sharding_label(ctx.setup)}")
    if ctx.spec.arch.unmodelled_layers:
        notes.append(f"not modelled: the {', '.join(ctx.spec.arch.unmodelled_layers)} layers' own activations "
                     "(a token mixer other than attention): this estimate is a lower bound")
    if ctx.spec.media:
        n = sum(p.numel for p in ctx.spec.media)
        notes.append(f"text-only steps: {', '.join(ctx.spec.arch.media_parts)} ({n / 1e6:,.1f}M parameters) held in "
                     "the weights, never run: no gradients, optimizer state or activations; image inputs are not "
                     "modelled")
    if reties_head(ctx.spec, ctx.setup):
        notes.append("resize_token_embeddings ties this checkpoint's own lm_head to the input embedding again "
                     "(transformers 5 forces T5's tie): one vocabulary table fewer, and the head's trained values "
                     "are replaced by the embedding's")
    if ctx.setup.quant == "mxfp4" and mxfp4_dequantized():
        notes.append("MXFP4 experts on a card below compute capability 7.5: transformers loads them dequantized to "
                     "bf16 (quantizer_mxfp4.py), 2 bytes per weight")
    if ctx.setup.quant == "fp8-dynamic" and not ctx.quantized:
        notes.append("compressed-tensors FP8 on a card below compute capability 8.9: transformers ignores "
                     "use_optimized_inference and decompresses the weights to 16 bit, 2 bytes per weight")
    elif ctx.setup.quant == "fp8-dynamic":
        notes.append("compressed-tensors FP8 kept in FP8 needs CompressedTensorsConfig(use_optimized_inference=True) "
                     "(transformers' default decompresses the weights to 16 bit on the first forward: estimate "
                     "without --quant for that)")
    if ctx.setup.quant == "fp8" and not ctx.quantized:
        notes.append("FP8 weights on a card below compute capability 8.9: transformers loads them dequantized to "
                     "16 bit (quantizer_finegrained_fp8.py), 2 bytes per weight")
    if ctx.training and opt.is_paged(ctx):
        notes.append("paged optimizer state lives in CUDA unified memory: outside allocated/reserved, "
                     "counted in the device total while resident")
    return tuple(notes)


def frame(models, setups=None, **fields):
    """Estimates as a pandas DataFrame, one row per model x setup (Estimate.summary's columns, bytes): `models` a
    model id or a list of them; `setups` a Setup, a dict of Setup fields or a list of either (default:
    Setup(**fields)). memplan.frame(["gpt2", "Qwen/Qwen3-0.6B"], [dict(batch_size=b) for b in (1, 8)])."""
    import pandas as pd
    models = [models] if isinstance(models, (str, ModelSpec)) else list(models)
    if setups is None:
        setups = [Setup(**fields)]
    elif isinstance(setups, (Setup, dict)):
        setups = [setups]
    setups = [s if isinstance(s, Setup) else Setup(**{**fields, **s}) for s in setups]
    return pd.DataFrame([estimate(m, s).summary() for m in models for s in setups])
