"""The real training step, shared by the tracer (fake or real CPU tensors) and the validator (CUDA, or the CPU).

One code path builds the model the way a user's script would - the real transformers class from the config, real
peft LoRA, transformers' own (non-reentrant) gradient checkpointing, peft's k-bit preparation, torch's or
transformers' optimizers - and runs forward, backward, optimizer step and zero_grad(set_to_none=True) on random
token batches of exactly batch_size x seq_len. Callers observe it through `enter_phase` and the two hooks of
`training_loop`; what differs between them is only where tensors live and how bitsandbytes is provided:
  - tracer and `validate --device cpu`: stand-ins holding bnb's exact storages (memplan.runtime.standins), CPU device;
  - `validate` on CUDA: real bitsandbytes Linear4bit/Linear8bitLt quantized from random weights, bnb optimizers.
Lazy torch: nothing is imported at module import.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from memplan.runtime.emulate.autocast import checkpoint_kwargs
from memplan.errors import BadInput, MemplanError, TraceFailed
from memplan.setup import LOW_RANK_ARGS, LOW_RANK_TARGETS, PREQUANTIZED, TORCH_DTYPE_NAMES, TRL_TRAINERS, Setup
from memplan.model import trainable as select
from memplan.model.compat import attn_impl, check_setup
from memplan.model.hf import CLASSIFIER_CLASSES, config_from_dict
from memplan.runtime.trl import add_head
from memplan.runtime.liger import apply_liger_kernels, apply_liger_standins
from memplan.runtime.standins import (StandInBnbOptimizer, StandInScheduleFree, StandInTorchaoAdamW,
                                      lora_custom_modules, mxfp4_standins, quantize_standins)
from memplan import libs

TRAIN_PHASES = ("forward", "backward", "optimizer", "zero_grad")


class _OptionalKernelNotice(logging.Filter):
    """Drops bitsandbytes' warning that its optional CPU 4-bit kernel (the `kernels` package) is missing: printed at
    every model build on a CPU with AVX512-BF16, read by users as a failure, and irrelevant to memory
    (bitsandbytes/backends/cpu/ops.py falls back to its own kernel)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelNotice())


def torch_dtypes() -> dict:
    import torch
    return {k: getattr(torch, v) for k, v in TORCH_DTYPE_NAMES.items()}


# ---------------------------------------------------------------------------------------------------- optimizer

#: bitsandbytes optimizers by memplan name: (bitsandbytes.optim class Trainer builds, states, bits)
BNB_OPTIMIZERS = {"adamw-8bit": ("AdamW8bit", 2, 8), "paged-adamw-8bit": ("PagedAdamW8bit", 2, 8),
                  "paged-adamw-32bit": ("PagedAdamW32bit", 2, 32), "lion-8bit": ("Lion8bit", 1, 8),
                  "lion-32bit": ("Lion32bit", 1, 32), "paged-lion-8bit": ("PagedLion8bit", 1, 8),
                  "paged-lion-32bit": ("PagedLion32bit", 1, 32)}


def make_optimizer(setup: Setup, params, standin_tracker=None, model=None):
    """The optimizer Trainer builds for setup.optimizer. standin_tracker: use the bnb 8-bit stand-in (tracer, CPU);
    None: real bitsandbytes (CUDA). model: its nn.Embedding weights get 32-bit state under a bnb 8-bit optimizer, as
    Trainer.create_optimizer registers them (GlobalOptimManager.register_module_override(..., {"optim_bits": 32}))."""
    import torch
    params = [p for p in params if p.requires_grad]
    opt = setup.optimizer
    if opt == "adamw":  # CUDA's default for torch.optim.AdamW (foreach); the tracer forces it on the CPU too
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if opt == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if opt in BNB_OPTIMIZERS:
        cls_name, states, bits = BNB_OPTIMIZERS[opt]
        paged = opt.startswith("paged")
        embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)] if model is not None else []
        if standin_tracker is not None:
            return StandInBnbOptimizer(params, standin_tracker, paged=paged, fp32={id(m.weight) for m in embeddings},
                                       states=states, bits=bits)
        import bitsandbytes as bnb  # what Trainer's optim string builds (training_args.OptimizerNames)
        if bits == 8:
            manager = bnb.optim.GlobalOptimManager.get_instance()
            for m in embeddings:
                manager.register_module_override(m, "weight", {"optim_bits": 32})
        return getattr(bnb.optim, cls_name)(params, lr=1e-4)
    if opt in ("adamw-torch-8bit", "adamw-torch-4bit"):
        bits = 8 if opt.endswith("8bit") else 4
        if standin_tracker is not None:
            return StandInTorchaoAdamW(params, standin_tracker, paged=False, bits=bits)
        try:
            from torchao.optim import AdamW4bit, AdamW8bit
        except ImportError:
            raise BadInput(f"--optimizer {opt} runs torchao's low-bit AdamW: pip install torchao") from None
        return (AdamW8bit if bits == 8 else AdamW4bit)(params, lr=1e-4, block_size=256)
    if opt == "schedule-free-adamw":
        if standin_tracker is not None:
            return StandInScheduleFree(params, standin_tracker, paged=False)
        try:
            import schedulefree
        except ImportError:
            raise BadInput("--optimizer schedule-free-adamw runs schedulefree.AdamWScheduleFree: pip install "
                           "schedulefree") from None
        optimizer = schedulefree.AdamWScheduleFree(params, lr=1e-4)
        optimizer.train()  # Trainer calls optimizer.train() before training steps
        return optimizer
    if opt == "adafactor":  # what Trainer's optim="adafactor" builds
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False, warmup_init=False)
    if opt == "sgd":
        return torch.optim.SGD(params, lr=1e-4, foreach=True)
    if opt in LOW_RANK_ARGS:
        return low_rank_optimizer(model, params, opt)
    raise BadInput(f"optimizer {opt!r} cannot be run")


#: the low-rank optimizers' classes: (module, class, package to install)
LOW_RANK_CLASSES = {"galore-adamw": ("galore_torch", "GaLoreAdamW", "galore-torch"),
                    "apollo-adamw": ("apollo_torch", "APOLLOAdamW", "apollo-torch")}


def low_rank_optimizer(model, params, opt: str):
    """galore_torch.GaLoreAdamW / apollo_torch.APOLLOAdamW as Trainer builds them for optim="galore_adamw" /
    "apollo_adamw" (trainer_optimizer.py _setup_low_rank_optimizer): the weights of the nn.Linear modules whose name
    holds one of setup.LOW_RANK_TARGETS in one group with setup.LOW_RANK_ARGS and proj_type "std"; every other
    trainable tensor in a plain group."""
    import importlib

    import torch
    module, name, package = LOW_RANK_CLASSES[opt]
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError:
        raise BadInput(f"--optimizer {opt} runs {module}.{name}: pip install {package}") from None
    targets = {id(m.weight) for mname, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and any(t in mname for t in LOW_RANK_TARGETS) and m.weight.requires_grad}
    projected = [p for p in params if id(p) in targets]
    rest = [p for p in params if id(p) not in targets]
    return cls([{"params": rest}, {"params": projected, **LOW_RANK_ARGS[opt], "proj_type": "std"}], lr=1e-4)


# ---------------------------------------------------------------------------------------------------- model

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers")


def cut_config(d: dict, layers: int) -> dict:
    """The config with every layer count set to `layers` (per-layer lists truncated); a composite config's language
    model (text_config) only: its vision tower is held whole."""
    d = dict(d)
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = cut_config(d["text_config"], layers)
    for k in _LAYER_KEYS:
        if isinstance(d.get(k), int):
            d[k] = min(d[k], layers)
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    return d


def build_model(spec, setup: Setup, layers: int | None, d: dict, quantizer: Callable | None = None,
                real_kernels: bool = False):
    """The real transformers model for the setup on the meta device: dtype, quantized linears, k-bit preparation,
    freezing, LoRA, checkpointing. materialize() then gives it storage. Built on meta because module.to()/peft's
    adapter moves swap fake parameters, which torch refuses while the fake mode holds weakrefs.

    quantizer(model, names, setup, compute_dtype): replaces the named Linear modules (default: the bnb stand-ins).
    real_kernels: Liger's own Triton kernels (CUDA runs) instead of the stand-ins that hold what they allocate.
    """
    import accelerate
    import peft
    import transformers

    quantizer = quantizer or quantize_standins
    dtypes = torch_dtypes()
    check_setup(spec, setup)
    config = config_from_dict(d)
    if spec.arch.auto_class == "AutoModelForSequenceClassification" and getattr(config, "pad_token_id", None) is None:
        # a decoder's classifier pools each row's last non-pad token and refuses batches > 1 without a pad token,
        # which scripts set from eos (the batches here hold no padding: the last position)
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    cls = getattr(transformers, spec.arch.auto_class)
    weight_dtype = dtypes[setup.weight_dtype] if not setup.quant else dtypes[setup.compute_dtype]
    # transformers 4.56 renamed from_config's torch_dtype to dtype (modeling_utils.PreTrainedModel._from_config)
    dtype_kw = "torch_dtype" if libs.parse(transformers.__version__) < (4, 56) else "dtype"
    with accelerate.init_empty_weights(include_buffers=True):
        model = cls.from_config(config, attn_implementation=attn_impl(spec, setup), **{dtype_kw: weight_dtype})
        untie_like_checkpoint(model, spec)
        if setup.added_tokens:  # what a user adding tokens calls; mean_resizing samples from the old rows' statistics
            model.resize_token_embeddings(spec.arch.vocab_size + setup.added_tokens, mean_resizing=False)
    if setup.quant == "mxfp4":  # gpt-oss's experts, served (setup validation refuses training)
        mxfp4_standins(model)
    elif setup.quant:
        names = [m.name for m in select.quantized_linears(spec) if _exists(model, m.name)]
        quantizer(model, names, setup, dtypes[setup.compute_dtype])
        # what transformers' bnb quantizer sets; peft's prepare_model_for_kbit_training only enables gradient
        # checkpointing on models flagged as loaded in k-bit
        model.is_loaded_in_4bit = setup.quant in ("nf4", "fp4")
        model.is_loaded_in_8bit = setup.quant == "int8"
        if setup.quant.startswith("gptq"):  # what transformers' GptqHfQuantizer sets: peft's k-bit preparation then
            model.quantization_method = "gptq"  # keeps the 16-bit weights (no fp32 upcast) and enables checkpointing
        elif setup.quant == "awq":  # transformers' AwqQuantizer: peft upcasts the rest, enables no checkpointing
            model.quantization_method = "awq"
        elif setup.quant.startswith("torchao"):  # TorchAoHfQuantizer: peft keeps the dtype, enables checkpointing
            model.quantization_method = "torchao"
    if setup.mode != "train":
        model.eval()
        return model
    if setup.trainer in TRL_TRAINERS:  # the trainers patch the transformers model (peft's base model)
        add_head(model, setup.trainer)
    # an FP8 model trains as loaded (transformers' FP8LinearFunction); TRL's trainers prepare no k-bit model
    if setup.quant and setup.quant != "fp8" and not setup.trl_kbit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=setup.grad_ckpt,
                                                     gradient_checkpointing_kwargs=checkpoint_kwargs())
    unprepared = not setup.quant or setup.quant in ("awq", "fp8") or setup.trl_kbit
    if setup.grad_ckpt and unprepared:  # Trainer's gradient_checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs())
    if setup.technique == "freeze":
        keep = {p.name for p in select.trainable_params(cut_spec(spec, layers), setup)}
        for name, p in model.named_parameters():
            p.requires_grad_(name in keep)
        if setup.grad_ckpt:
            model.enable_input_require_grads()
    if setup.uses_lora:
        targets = setup.lora_targets
        if targets is None:
            targets = list(spec.arch.lora_default_targets)
        cfg = peft.LoraConfig(r=setup.lora_r, lora_alpha=setup.lora_alpha, lora_dropout=setup.lora_dropout,
                              target_modules=list(targets) if isinstance(targets, tuple) else targets,
                              use_dora=setup.use_dora, **select.new_token_kwargs(spec, setup))
        if setup.quant in PREQUANTIZED:
            cfg._register_custom_module(lora_custom_modules())
        model = peft.get_peft_model(model, cfg)
        if setup.trl_kbit:  # TRL casts a quantized model's trainable adapters to bf16, DoRA's magnitude apart
            import torch
            for name, p in model.named_parameters():
                if p.requires_grad and "lora_magnitude_vector" not in name:
                    p.data = p.data.to(torch.bfloat16)
    model.train()
    if setup.use_liger_kernel:  # Trainer.train() applies it to the built (peft) model's base
        (apply_liger_kernels if real_kernels else apply_liger_standins)(model, head=setup.trainer == "hf")
    return model


def untie_like_checkpoint(model, spec) -> None:
    """Give the model a separate output embedding where the inventory has one (spec.tied lacks the head).

    transformers 5.23 forces T5Config/MT5Config.tie_word_embeddings=True (configuration_t5.py / configuration_mt5.py
    __post_init__), so from_config ties lm_head to shared; from_pretrained does not when the checkpoint holds both
    with different values (modeling_utils.PreTrainedModel.tie_weights: "both are present in the checkpoints with
    different values, so we will NOT tie them") - flan-t5-xl, T0_3B, mt0-xxl.
    memplan.inventory.build._honour_untied_file counts that head; the traced model must hold it too."""
    import torch
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return
    head = next(n for n, m in model.named_modules() if m is out) + ".weight"
    if head in dict(spec.tied):
        return
    w = out.weight
    out.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=w.device), requires_grad=w.requires_grad)
    getattr(model, "all_tied_weights_keys", {}).pop(head, None)  # as from_pretrained does when it skips the tie


def materialize(model, fake: bool, device: str = "cpu") -> None:
    """Give every meta parameter and buffer storage on `device` (fake, or real and randomly initialised N(0, 0.02)),
    keeping shared (tied) tensors shared and requires_grad as built. Already materialised tensors are kept."""
    import torch
    done: dict[int, torch.Tensor] = {}

    def make(t):
        if id(t) in done:
            return done[id(t)]
        if not t.is_meta:
            return t
        new = torch.empty(t.shape, dtype=t.dtype, device=device)
        if not fake:
            if new.is_floating_point() and new.element_size() == 1:
                # torch has no normal_ kernel for the float8 dtypes (FP8 checkpoints' weights): draw in bf16, cast
                new.copy_(torch.empty(t.shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02))
            elif new.is_floating_point():
                new.normal_(0, 0.02)
            else:
                new.zero_()
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        done[id(t)] = new
        return new

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = make(p)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = make(b)


def _exists(model, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def cut_spec(spec, layers: int | None):
    """The spec restricted to blocks < layers (for freezing's 'last N blocks' on a cut model)."""
    if not layers:
        return spec
    from dataclasses import replace
    params = tuple(p for p in spec.params if p.block is None or p.block < layers)
    linears = tuple(m for m in spec.linears if m.block is None or m.block < layers)
    return replace(spec, params=params, linears=linears, buffers=())


def make_batch(spec, setup: Setup, vocab: int, device="cpu") -> dict:
    """Random token ids of exactly batch_size x seq_len (seq2seq: labels of target_len). setup.padded: one padding
    token (last sample, last position, label -100), so transformers builds the masks it skips for all-ones batches;
    the tracer answers those checks for its fake masks (memplan.runtime.emulate.masks.mask_checks)."""
    import torch

    b, s = setup.batch_size, setup.seq_len
    ids = torch.randint(0, vocab, (b, s), device=device)
    mask = torch.ones(b, s, dtype=torch.long, device=device)
    if setup.padded:
        mask[-1, -1] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    labels = classifier_labels(spec)
    if labels:  # a classification head (--task seq-cls / token-cls): a label per sample, or per token
        shape = (b,) if "Sequence" in spec.arch.auto_class else (b, s)
        batch["labels"] = torch.randint(0, labels, shape, device=device)
    elif spec.arch.kind == "seq2seq":
        batch["labels"] = torch.randint(0, vocab, (b, setup.target_len or s), device=device)
    else:
        batch["labels"] = ids.clone()
        if setup.padded:
            batch["labels"][-1, -1] = -100
    return batch


def classifier_labels(spec) -> int:
    """The label count of a classification head (the out_features of its last Linear, transformers' num_labels);
    0 for a language-model head."""
    if spec.arch.auto_class not in CLASSIFIER_CLASSES or not spec.linears:
        return 0
    return spec.linears[-1].out_features


# ---------------------------------------------------------------------------------------------------- loops

def autocast_for(setup: Setup, device: str):
    """Trainer runs autocast with bf16=True/fp16=True: mixed precision, and quantized bases (the QLoRA recipe and
    the plan files set bf16/fp16 there; the estimate assumes it)."""
    import torch
    if setup.mixed or (setup.quant and setup.compute_dtype != "fp32"):
        return torch.autocast(device, dtype=torch_dtypes()[setup.compute_dtype])
    return contextlib.nullcontext()


def training_loop(model, opt, spec, setup: Setup, steps: int, device: str, enter_phase: Callable[[str], None],
                  forward_ctx: Callable = contextlib.nullcontext, after_backward: Callable | None = None,
                  after_step: Callable | None = None) -> None:
    """`steps` optimizer steps of min(grad_accum, 2) micro-batches each (any accumulation > 1 keeps the gradients
    alive across micro-steps the same way; more micro-steps change no memory). enter_phase(name) is called as
    each of TRAIN_PHASES starts and with "between" after zero_grad."""
    vocab = spec.arch.vocab_size  # token ids the batch draws from (peft's TrainableTokensWrapper has no num_embeddings)
    autocast = autocast_for(setup, device)

    def forward(micro: int):
        batch = make_batch(spec, setup, vocab, device)
        enter_phase("forward")
        with autocast, forward_ctx():
            return model(**batch).loss, batch

    run_steps(opt, steps, min(setup.grad_accum, 2), forward, enter_phase, after_backward, after_step)


def run_steps(opt, steps: int, accum: int, forward: Callable, enter_phase: Callable[[str], None],
              after_backward: Callable | None = None, after_step: Callable | None = None,
              micro_ctx: Callable = contextlib.nullcontext) -> None:
    """`steps` optimizer steps of `accum` micro-steps each, the one loop of training_loop and TRL's (runtime.trl_step):
    forward(micro) runs micro-step `micro`'s forward (entering its phases) and returns (loss, what stays referenced
    until the backward is done: the batch); then backward, the optimizer step and zero_grad(set_to_none=True).
    micro_ctx: entered around each micro-step's forward and backward, as a TRL trainer's training_step wraps them
    (its activation offloading, whose __enter__ drops what the last micro-step left behind)."""
    for _ in range(steps):
        for micro in range(accum):
            with micro_ctx():
                loss, held = forward(micro)
                enter_phase("backward")
                loss.backward()
                del loss, held
            if after_backward is not None:
                after_backward()
        enter_phase("optimizer")
        opt.step()
        enter_phase("zero_grad")
        opt.zero_grad(set_to_none=True)
        enter_phase("between")
        if after_step is not None:
            after_step()


def no_eos(model) -> None:
    """generate() runs to its max length, as the estimate assumes: no end-of-sequence stop."""
    with contextlib.suppress(AttributeError):
        model.generation_config.eos_token_id = None


def _takes(model, name: str) -> bool:
    """Whether model.forward accepts `name` (transformers GenerationMixin._supports_logits_to_keep checks the same)."""
    import inspect
    return name in inspect.signature(model.forward).parameters


def inference_loop(model, spec, setup: Setup, device: str, enter_phase: Callable[[str], None]) -> None:
    """Prefill the prompt (prompt_len or seq_len tokens), then generate new_tokens greedily with the KV cache (no
    early stop). Encoders: one forward pass. setup.padded: one padding token, left in decoders (they generate)."""
    import torch
    b = setup.batch_size
    prompt = setup.prompt_len or setup.seq_len
    vocab = spec.arch.vocab_size  # token ids the batch draws from (peft's TrainableTokensWrapper has no num_embeddings)
    ids = torch.randint(0, vocab, (b, prompt), device=device)
    mask = torch.ones(b, prompt, dtype=torch.long, device=device)
    if setup.padded:
        mask[(0, 0) if spec.arch.kind == "causal" else (-1, -1)] = 0
    autocast = autocast_for(setup, device)
    new = setup.new_tokens if setup.new_tokens is not None else (0 if spec.arch.kind == "encoder" else 128)
    with torch.no_grad(), autocast:
        enter_phase("prefill")
        if spec.arch.kind == "seq2seq":
            start = torch.zeros(b, 1, dtype=torch.long, device=device)
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=start, use_cache=True)
        elif spec.arch.kind == "encoder":
            model(input_ids=ids, attention_mask=mask)
        else:  # as generate() prefills: last-position logits only where the model takes logits_to_keep
            keep = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
            model(input_ids=ids, attention_mask=mask, use_cache=True, **keep)
        if new and spec.arch.kind != "encoder":
            enter_phase("decode")
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, use_cache=True, pad_token_id=0)
        enter_phase("between")


@contextlib.contextmanager
def library_failures(what: str, why: str):
    """An error raised inside torch/transformers/peft while `what` runs, as one TraceFailed message (its first line
    and `why`), not a traceback; memplan's own errors pass through."""
    try:
        yield
    except MemplanError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise TraceFailed(f"{what} failed inside torch/transformers/peft: {type(e).__name__}: {first}\n{why}; "
                          "`memplan estimate` does not run the model and is unaffected.") from e
