"""validate: run a setup for real and measure its memory - on CUDA the ground truth, on the CPU a code-path check.

Each setup runs in its own Python subprocess (`python -m memplan.measure.runner '<json>'`), so the caching allocator's
fragmentation, a leaked tensor or an out-of-memory error cannot affect the next one; an OOM is a recorded result
(status "oom"), a crash of the subprocess an "error" row, never an exception in the caller.

CUDA (the model built with random weights directly on the GPU, bitsandbytes quantizing random weights for real):
  cuda_context_bytes   NVML used after torch.cuda.init(), minus NVML used before it (other processes excluded)
  allocated/reserved   torch.cuda.max_memory_allocated / max_memory_reserved over the steps (reset after the build,
                       so the peak covers the steps with the weights resident), and per phase
  device               the highest NVML used sample (taken at every phase change) minus the pre-init baseline
  alloc_retries, num_ooms   from torch.cuda.memory_stats()
A memory cap (`memory_fraction`, or `emulate` a catalog GPU) is applied with torch.cuda.set_per_process_memory_fraction:
the allocator may reserve at most the emulated card's memory less the measured CUDA context.
CPU (`device="cpu"`): the same steps with real tensors under the tracer's storage accounting (memplan.tracer.training's
StorageTracker, bnb stand-ins) - allocated only; never process RSS.
"""
from __future__ import annotations

import contextlib

import functools
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict

from memplan.errors import BadInput
from memplan.measure.meter import CudaMeter, Measurement
from memplan.setup import Setup
from memplan.gpus import find_gpu
from memplan.measure.rows import environment
from memplan.model.catalog import config_dict, load_spec, spec_for_task
from memplan.model.compat import check_setup
from memplan.runtime.emulate.cuda import cuda_like
from memplan.runtime.steps import build_model, inference_loop, make_optimizer, materialize, no_eos, training_loop
from memplan.runtime.standins import quantize_standins
from memplan.runtime.trl_step import reference_model, trl_loop
from memplan.setup import LORA_PREQUANTIZED, PREQUANTIZED, TRL_TRAINERS, trainer_rows
from memplan.model.compat import attn_impl
from memplan.runtime.tracker import StorageTracker, dispatch_mode

DEFAULT_STEPS = 3
_MARK = "MEMPLAN-VALIDATE-RESULT "


# ---------------------------------------------------------------------------------------------------- one run

def quantize_bnb(device: str):
    """A build_model quantizer: real bitsandbytes Linear4bit / Linear8bitLt from random weights, quantized on
    `device` the way transformers' bnb loader does (Params4bit / Int8Params quantize when moved to the GPU)."""
    def quantize(model, names, setup: Setup, compute_dtype) -> None:
        import bitsandbytes as bnb
        import torch
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            src = getattr(parent, child)
            if type(src).__name__ == "Conv1D":  # GPT-2: weight [in, out]
                in_f, out_f = src.weight.shape
            else:
                in_f, out_f = src.in_features, src.out_features
            bias = src.bias is not None
            if setup.quant == "int8":
                new = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias, has_fp16_weights=False, threshold=6.0,
                                          device="meta")
                w = torch.empty(out_f, in_f, dtype=torch.float16).normal_(0, 0.02)
                new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            else:
                new = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=compute_dtype,
                                        compress_statistics=setup.double_quant, quant_type=setup.quant,
                                        quant_storage=torch.uint8, device="meta")
                # made on the device (Params4bit quantizes on its first move there): a 14B model's weights never
                # pass through host memory
                w = torch.empty(out_f, in_f, dtype=compute_dtype, device=device).normal_(0, 0.02)
                new.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=setup.double_quant,
                                               quant_type=setup.quant, quant_storage=torch.uint8, module=new)
            if bias:
                new.bias = torch.nn.Parameter(torch.zeros(out_f, dtype=compute_dtype), requires_grad=False)
            new.to(device)
            setattr(parent, child, new)
    return quantize


def measure(model_id: str, setup: Setup, device: str = "cuda", steps: int = DEFAULT_STEPS,
            memory_fraction: float | None = None, emulate_bytes: int | None = None,
            shared_gpu: bool = False) -> Measurement:
    """Run `setup` on `model_id` in this process and measure it (validate() runs this in a subprocess)."""

    spec = spec_for_task(load_spec(model_id), setup.task)
    check_setup(spec, setup)  # model-dependent setup problems, with their messages
    # the stand-ins run the training kernels' allocations, torchao's linear and compressed-tensors' input
    # quantization op for op on CUDA
    runs_stand_in = ((setup.quant in LORA_PREQUANTIZED and setup.mode == "train")
                     or str(setup.quant).startswith("torchao") or setup.quant == "fp8-dynamic")
    if setup.quant in PREQUANTIZED and device != "cpu" and not runs_stand_in:
        raise BadInput(f"validating a {setup.quant} checkpoint on CUDA needs its kernels (gptqmodel's Marlin, "
                       "transformers' FP8 Triton kernel from the `kernels` hub), which memplan does not build yet: "
                       "use --device cpu for the stand-ins' accounting, or `memplan trace`")
    env = environment(device)
    if device == "cpu":
        m = _measure_cpu(spec, setup, steps)
    else:
        m = _measure_cuda(spec, setup, config_dict(spec), steps, memory_fraction, emulate_bytes, shared_gpu)
    m.environment = env
    return m


def _measure_cuda(spec, setup, d, steps, memory_fraction, emulate_bytes, shared_gpu=False,
                  meter: CudaMeter | None = None) -> Measurement:
    """validate's CUDA run in this process. meter: a CudaMeter made by the caller (benchmarks/gpu_alloc_trace.py
    records the allocator's history from its start) instead of one from memory_fraction and emulate_bytes."""
    import torch

    meter = meter or CudaMeter(memory_fraction, emulate_bytes, shared_gpu)
    try:
        rows = trainer_rows(setup, attn_impl(spec, setup))  # the rows a TRL trainer runs (setup itself otherwise)
        # LoRA on a GPTQ base trains through gptqmodel's torch path, which the stand-in runs op for op on CUDA; on
        # an AWQ base the stand-in allocates what the AWQ kernels allocate (their values are not computed)
        quantizer = quantize_standins if setup.quant in PREQUANTIZED else quantize_bnb("cuda")
        model = build_model(spec, rows, None, d, quantizer=quantizer, real_kernels=True)
        materialize(model, fake=False, device="cuda")
        ref = reference_model(spec, setup, None, d, build_model, "cuda")
        opt = make_optimizer(rows, model.parameters(), model=model) if setup.mode == "train" else None
        meter.start()
        if opt is None:
            inference_loop(model, spec, setup, "cuda", meter.enter)
        elif setup.trainer in TRL_TRAINERS:
            no_eos(model)
            offload = _trl_offloading(model, setup)
            trl_loop(model, ref, opt, spec, setup, rows, steps, "cuda", meter.enter, micro_ctx=lambda: offload)
        else:
            training_loop(model, opt, spec, setup, steps, "cuda", meter.enter)
        return meter.result("ok", steps)
    except torch.OutOfMemoryError as e:
        return meter.result("oom", steps, str(e).splitlines()[0])


def _trl_offloading(model, setup):
    """TRL's own activation offloading (trl/models/activation_offloading.py): one manager, entered around each
    micro-step's forward and backward as SFTTrainer.training_step / DPOTrainer.training_step enter it (trl 1.16;
    the rows measured before 2026-11-27 entered it once around all steps: data/measured/gpu-h200-offload-loop.csv);
    a null context without it."""
    if not setup.activation_offloading:
        return contextlib.nullcontext()
    from trl.models.activation_offloading import get_act_offloading_ctx_manager
    return get_act_offloading_ctx_manager(model=model)


def _measure_cpu(spec, setup, steps) -> Measurement:
    """The tracer's real-tensor accounting (storages rounded to 512 B like the CUDA allocator's smallest block)."""
    tracker = StorageTracker()
    rows = trainer_rows(setup, attn_impl(spec, setup))
    model = build_model(spec, rows, None, config_dict(spec))

    def enter(phase: str) -> None:
        tracker.phase = phase

    with dispatch_mode(tracker), cuda_like(rows.padded, spec.arch.kind == "seq2seq"):
        materialize(model, fake=False)
        ref = reference_model(spec, setup, None, config_dict(spec), build_model, "cpu")
        for t in [*model.parameters(), *model.buffers(), *(ref.parameters() if ref is not None else ())]:
            tracker.serial_of(t)
        if setup.mode == "train":
            opt = make_optimizer(rows, model.parameters(), standin_tracker=tracker, model=model)
            if setup.trainer in TRL_TRAINERS:
                no_eos(model)
                trl_loop(model, ref, opt, spec, setup, rows, steps, "cpu", enter)
            else:
                training_loop(model, opt, spec, setup, steps, "cpu", enter)
        else:
            no_eos(model)
            inference_loop(model, spec, setup, "cpu", enter)
    return Measurement(status="ok", device="cpu", steps=steps, allocated_bytes=tracker.peak,
                       phase_allocated=dict(tracker.phase_peaks), peak_phase=tracker.peak_phase)


# ---------------------------------------------------------------------------------------------------- isolation

def validate(model_id: str, setup: Setup, device: str = "cuda", steps: int = DEFAULT_STEPS,
             memory_fraction: float | None = None, emulate: str | None = None, timeout: float | None = None,
             shared_gpu: bool = False) -> Measurement:
    """Measure one setup in a fresh subprocess. Never raises for what happens inside it: an OOM is status "oom",
    anything else (a crash, a timeout, a model that cannot be built) status "error" with the reason.
    shared_gpu: other runs use the GPU at the same time (benchmarks/gpu_pool.py): the allocator's peaks are still
    this process's own, but NVML's device-level figures (device total, CUDA context) are not recorded."""
    if device not in ("cuda", "cpu"):
        raise BadInput(f"device must be cuda or cpu, got {device!r}")
    if steps < 2:
        raise BadInput("validate needs at least 2 steps (optimizer state exists from the second on); default 3")
    if device == "cuda":
        require_cuda()
    emulate_bytes = None
    if emulate:
        emulate_bytes = find_gpu(emulate).memory_bytes
    job = {"model": model_id, "setup": setup.to_dict(), "device": device, "steps": steps,
           "memory_fraction": memory_fraction, "emulate_bytes": emulate_bytes, "shared_gpu": shared_gpu}
    try:
        proc = run_tied([sys.executable, "-m", "memplan.measure.runner", json.dumps(job)], timeout)
    except subprocess.TimeoutExpired:
        return Measurement(status="error", device=device, steps=steps, error=f"timed out after {timeout} s")
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return Measurement(**json.loads(line[len(_MARK):]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return Measurement(status="error", device=device, steps=steps,
                       error=f"subprocess exited {proc.returncode}: " + " | ".join(tail))


def _die_with_parent(parent: int) -> None:
    """In the child before it runs (Linux): the kernel kills it when its parent dies (prctl PR_SET_PDEATHSIG), so a
    killed sweep leaves no run holding GPU memory while the resume measures. A parent that died before the call
    has already left the child to another process: it exits at once."""
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def run_tied(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), with the child tied to this process:
    killed with it (SIGKILL, Linux), on a timeout and on an exception here (Ctrl-C)."""
    tie = functools.partial(_die_with_parent, os.getpid()) if sys.platform.startswith("linux") else None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=tie) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def require_cuda() -> None:
    """BadInput (exit 2) with what to do when no CUDA device is usable."""
    import torch
    if not torch.cuda.is_available():
        raise BadInput("no CUDA device available: validate measures real GPU memory. Run it on a machine with an "
                       "NVIDIA GPU and a CUDA build of torch, or pass --device cpu to run the same steps on the CPU "
                       "(allocated bytes through the tracer's accounting)")


def _worker(arg: str) -> None:
    """Subprocess entry: run one job, print one marked JSON line (errors included)."""
    job = json.loads(arg)
    setup = Setup(**job["setup"])
    try:
        m = measure(job["model"], setup, job["device"], job["steps"], job["memory_fraction"], job["emulate_bytes"],
                    job.get("shared_gpu", False))
    except Exception as e:  # reported as an "error" row by the parent, with the reason
        m = Measurement(status="error", device=job["device"], steps=job["steps"],
                        error=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
    print(_MARK + json.dumps(asdict(m)), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
