"""TRL's step around its fused head (memplan.runtime.trl), shared by the tracer and the validator: SFT's loss,
DPO's reference forward inside the loss, GRPO's generation and reference scoring before the step
(memplan.estimator.trainers describes the phases). Lazy torch: nothing is imported at module import."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

from memplan.runtime.steps import autocast_for, make_batch, materialize, run_steps
from memplan.runtime.trl import add_head, cuda_head, scored
from memplan.setup import Setup, generation_steps, needs_reference_model, prompt_tokens, recomputes_old_logps

#: the tokens GRPO's generate() makes where not max_completion_length: a tracer run that generates a few tokens only,
#: the rest of the step at the setup's length (memplan.replay.decode synthesizes the other decode steps)
GENERATED = contextvars.ContextVar("memplan_generated_tokens", default=None)


def generated_tokens(user: Setup) -> int:
    """The tokens GRPO's generate() makes in this run: GENERATED where set, else max_completion_length."""
    return GENERATED.get() or user.max_completion_length


def trl_loop(model, ref, opt, spec, user: Setup, rows: Setup, steps: int, device: str,
             enter_phase: Callable[[str], None], forward_ctx: Callable = contextlib.nullcontext,
             after_backward: Callable | None = None, after_step: Callable | None = None,
             micro_ctx: Callable = contextlib.nullcontext) -> None:
    """`steps` optimizer steps of a TRL trainer (training_loop's contract): GRPO generates (and scores the reference)
    every steps_per_generation micro-steps; each micro-batch runs the policy through the fused head (DPO: then the
    reference under no_grad). micro_ctx: what the trainer's training_step enters (run_steps)."""
    vocab = spec.arch.vocab_size
    autocast = autocast_for(rows, device)
    prompt = prompt_tokens(user)
    count = {"n": 0}
    every = generation_steps(user)

    def forward(micro: int):
        if user.trainer == "grpo" and micro % every == 0:  # mid-window when every < accumulation
            _grpo_prepare(model, ref, spec, user, rows, device, enter_phase, count, autocast)
        batch = make_batch(spec, rows, vocab, device)
        labels = batch.pop("labels")
        if prompt:
            labels[:, :prompt] = -100
        count["n"] = scored(rows.batch_size, rows.seq_len, prompt, rows.padded)
        enter_phase("forward")
        with autocast, forward_ctx():
            out = model(**batch, labels=labels, fused_lm_head=True, use_cache=False)
            return _loss(out, model, ref, batch, labels, user, enter_phase), (out, batch, labels)

    # CUDA runs TRL's own path (compaction, Triton kernels); elsewhere the head is made to take it
    embedding = model.get_input_embeddings().weight
    tied = embedding if embedding is getattr(model.get_output_embeddings(), "weight", None) else None
    with cuda_head(lambda: count["n"], tied) if device != "cuda" else contextlib.nullcontext():
        run_steps(opt, steps, min(user.grad_accum, 2), forward, enter_phase, after_backward, after_step, micro_ctx)


def _reference(model, ref, batch, labels):
    """The reference's log-probs under no_grad: its own model, or the policy with the adapter disabled."""
    import torch
    with torch.no_grad():
        if ref is not None:
            return ref(**batch, labels=labels, fused_lm_head=True, use_cache=False).log_probs
        with model.disable_adapter():
            return model(**batch, labels=labels, fused_lm_head=True, use_cache=False).log_probs


def _loss(out, model, ref, batch, labels, user: Setup, enter_phase):
    """The trainer's loss from the head's outputs."""
    import torch
    import torch.nn.functional as F

    if user.trainer == "sft":
        return out.loss
    if user.trainer == "dpo":
        logps = out.log_probs.sum(dim=1)
        if user.precompute_ref_log_probs:
            ref_logps = torch.zeros_like(logps)
        else:
            enter_phase("reference_forward")
            ref_logps = _reference(model, ref, batch, labels).sum(dim=1)
            enter_phase("forward")
        chosen, rejected = (logps - ref_logps).chunk(2, dim=0)
        return -F.logsigmoid(0.1 * (chosen - rejected)).mean()
    c = user.max_completion_length
    logps, mask = out.log_probs[:, -c:], (labels[:, 1:] != -100)[:, -c:].float()
    ratio = torch.exp(logps - logps.detach())
    advantages = torch.zeros(logps.shape[0], 1, device=logps.device)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 0.8, 1.28) * advantages)
    if user.beta > 0:
        ref_logps = torch.zeros_like(logps)  # computed before the step (_grpo_prepare)
        per_token = per_token + user.beta * (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _grpo_prepare(model, ref, spec, user: Setup, rows: Setup, device, enter_phase, count, autocast) -> None:
    """GRPO's generation (generate() of batch_size x grad_accum completions under no_grad; peft's generate runs
    outside accelerate's autocast wrapper) and, with beta > 0, the reference log-probs per batch_size rows."""
    import torch

    prompt = prompt_tokens(user)
    gen_rows = user.batch_size * generation_steps(user)
    ids = torch.randint(0, spec.arch.vocab_size, (gen_rows, prompt), device=device)
    mask = torch.ones(gen_rows, prompt, dtype=torch.long, device=device)
    peft_model = hasattr(model, "disable_adapter")
    if not user.use_vllm:  # vLLM generates in its own engine (measured separately: vllm_gpu_memory_utilization)
        enter_phase("generation")
        with torch.no_grad(), (contextlib.nullcontext() if peft_model else autocast):
            length = generated_tokens(user)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
                           do_sample=False, use_cache=True, pad_token_id=0)
    del ids, mask
    passes = [("reference_forward", lambda b, lab: _reference(model, ref, b, lab))] if user.beta > 0 else []
    if recomputes_old_logps(user):  # the policy's own log-probs of the generated batch, under no_grad
        passes.append(("old_logps_forward", lambda b, lab: _policy_logps(model, b, lab)))
    for phase, score in passes:
        enter_phase(phase)
        for _ in range(min(generation_steps(user), 2)):  # per_device_train_batch_size rows at a time
            batch = make_batch(spec, rows, spec.arch.vocab_size, device)
            labels = batch.pop("labels")
            labels[:, :prompt] = -100
            count["n"] = scored(rows.batch_size, rows.seq_len, prompt, rows.padded)
            with autocast:
                score(batch, labels)
            del batch, labels


def _policy_logps(model, batch, labels):
    import torch
    with torch.no_grad():
        return model(**batch, labels=labels, fused_lm_head=True, use_cache=False).log_probs


def reference_model(spec, user: Setup, layers, d: dict, build, device: str | None = None):
    """TRL's second model for the reference (reference_setup), frozen, with a log-probs-only head; None where there
    is none. build: steps.build_model; device: materialise it there with random weights (None: the caller does)."""
    ref_setup = reference_setup(user)
    if ref_setup is None:
        return None
    ref = build(spec, ref_setup, layers, d)
    if device is not None:
        materialize(ref, fake=False, device=device)
        add_head(ref, None)
    return ref


def reference_setup(user: Setup) -> Setup | None:
    """The setup a separate reference model is built with (inference: frozen, the policy's dtype), or None where
    the reference is the policy with its adapter disabled, or there is none."""
    if not needs_reference_model(user):
        return None
    return dataclasses.replace(Setup(), mode="infer", precision=user.precision, attn_impl=user.attn_impl,
                               task=user.task)
