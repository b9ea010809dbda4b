"""Inference traced on fake tensors, for the allocator replay: the prefill and generate() that `memplan validate` runs
(memplan.runtime.steps.inference_loop), every storage born and freed in order (StorageTracker.events).

Two host-side decisions inside generate() read a value from the device, which fake tensors do not hold; both are
known without it, so they are answered and nothing else is:
- the right-padding warning (`torch.any(attention_mask[:, -1] == 0).item()`, decoder-only models): validate's
  batches never end in padding (decoders pad on the left: steps.inference_loop), so False;
- the stop decision (generation.utils.StopCheck, `unfinished_sequences.max() == 0`): no end-of-sequence token is
  set, so generation stops exactly at the max length: the prompt and the new tokens (an encoder-decoder's decoder:
  its start token and the new tokens).
Any other read of a device value still raises (TraceFailed names the tracer's limit)."""
from __future__ import annotations

import contextlib

from memplan.errors import TraceFailed
from memplan.tracer.host_reads import answered_reads, called_from
from memplan.setup import Setup
from memplan.model.catalog import config_dict
from memplan.runtime.emulate.cuda import cuda_like
from memplan.runtime.steps import library_failures, build_model, inference_loop, materialize, no_eos
from memplan.runtime.tracker import StorageTracker, dispatch_mode


def inference_events(spec, setup: Setup) -> list[tuple[int, int, str]]:
    """(serial, bytes, phase) of every storage event of validate's inference run: 'setup' (the build), 'prefill',
    'decode' (generate(), whose own prefill comes first), 'between'."""
    return inference_trace(spec, setup).events


def inference_trace(spec, setup: Setup):
    """The StorageTracker of validate's inference run (peaks per phase, weights tagged, every event kept)."""
    with library_failures(f"the traced inference of {spec.model_id}",
                          "A limit of the tracer (fake tensors on the CPU read no device values)"):
        return _traced(spec, setup)


def _traced(spec, setup: Setup):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.generation import utils as generation

    if not hasattr(generation, "StopCheck"):
        raise TraceFailed("this transformers release decides generate()'s stop inside its loop on the device; the "
                          "inference replay needs generation.utils.StopCheck (transformers 5.17 has it)")
    tracker = StorageTracker(events=True)
    model = build_model(spec, setup, None, config_dict(spec))
    # generate()'s sequence: the prompt and the new tokens; an encoder-decoder's is the decoder's, from its start token
    start = 1 if spec.arch.kind == "seq2seq" else (setup.prompt_len or setup.seq_len)
    length = start + (setup.new_tokens if setup.new_tokens is not None else 128)

    def enter(phase: str) -> None:
        tracker.phase = phase

    with _stop_at(generation.StopCheck, length), FakeTensorMode(allow_non_fake_inputs=True), _host_reads(), \
            dispatch_mode(tracker), cuda_like(setup.padded, spec.arch.kind == "seq2seq"):
        materialize(model, fake=True)
        for t in [*model.parameters(), *model.buffers()]:
            tracker.tag(t, "weights")
        no_eos(model)
        inference_loop(model, spec, setup, "cpu", enter)
    tracker.trainable, tracker.total = 0, sum(p.numel() for p in model.parameters())
    return tracker


@contextlib.contextmanager
def generation_answers(length: int):
    """generate()'s host-side decisions answered on fake tensors for a run to `length` tokens (TRL's GRPO
    generation, memplan.runtime.trl): the stop at the max length and the right-padding check."""
    from transformers.generation import utils as generation
    with _stop_at(generation.StopCheck, length), _host_reads():
        yield


@contextlib.contextmanager
def _stop_at(stop_check, length: int):
    """StopCheck answers from the sequence length (no end-of-sequence token: generation runs to the max length)."""
    original = stop_check.__call__
    stop_check.__call__ = lambda self, unfinished, tokens, current: current >= length
    try:
        yield
    finally:
        stop_check.__call__ = original


def _host_reads():
    """generate()'s own scalar reads (the right-padding check): False, what validate's batches hold."""
    return answered_reads(False, lambda: called_from("generation/utils.py", "generate"))
