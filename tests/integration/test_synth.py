"""memplan.replay.synth: a deep model's training events synthesized from a trace cut to 5 blocks equal the whole model's
trace, event by event (serials renumbered, bursts of frees as sets: memplan.replay.synth.canonical) - and where they
cannot (blocks of different kinds, a shallow model) the synthesis declines and the whole model is traced."""
from __future__ import annotations

import pytest

from memplan.setup import Setup


def _events(model, setup, synthesize):
    from memplan.replay.need import traced_events
    return traced_events(model, setup, 3, synthesize=synthesize)


@pytest.mark.parametrize("fields", [
    dict(technique="full", precision="bf16-mixed", optimizer="adamw", batch_size=2, seq_len=128, attn_impl="sdpa"),
    dict(technique="lora", precision="bf16", batch_size=2, seq_len=128, grad_ckpt=True, grad_accum=2, padded=True),
    dict(technique="full", precision="bf16", optimizer="adafactor", batch_size=1, seq_len=128, grad_ckpt=True),
])
def test_synthesized_gpt2_events_equal_the_whole_trace(fields):
    from memplan.replay import synth
    from memplan.model.catalog import load_spec
    from memplan.runtime.allocator import replayed

    setup = Setup(**fields)
    made = synth.events(load_spec("openai-community/gpt2"), setup, 3)
    assert made is not None, "gpt2's 12 identical blocks are synthesized"
    whole = _events("openai-community/gpt2", setup, synthesize=False)
    assert synth.canonical(synth.through_last_step(made)) == synth.canonical(synth.through_last_step(whole))
    a, b = replayed(made), replayed(whole)
    assert (a.peak_reserved, a.peak_allocated) == (b.peak_reserved, b.peak_allocated)


@pytest.mark.parametrize("fields", [
    dict(trainer="dpo", technique="lora", precision="bf16-mixed", grad_ckpt=True),
    dict(trainer="grpo", technique="lora", precision="bf16-mixed", grad_ckpt=True, max_completion_length=8,
         num_generations=2),
])
def test_trl_passes_through_the_blocks_are_synthesized(fields):
    """DPO's reference forward and GRPO's generate() pass through the blocks outside the training forward: each
    pass's template run is copied per middle block like the forward's (SmolLM2-135M: 30 blocks)."""
    from memplan.replay import synth
    from memplan.model.catalog import load_spec
    from memplan.runtime.allocator import replayed

    setup = Setup(batch_size=2, seq_len=128, attn_impl="sdpa", padded=True, **fields)
    made = synth.events(load_spec("HuggingFaceTB/SmolLM2-135M"), setup, 3)
    assert made is not None, f"{fields['trainer']}'s passes are synthesized"
    whole = _events("HuggingFaceTB/SmolLM2-135M", setup, synthesize=False)
    assert synth.canonical(synth.through_last_step(made)) == synth.canonical(synth.through_last_step(whole))
    a, b = replayed(made), replayed(whole)
    assert (a.peak_reserved, a.peak_allocated, a.phase_allocated) == (b.peak_reserved, b.peak_allocated,
                                                                      b.phase_allocated)


def test_a_long_grpo_generation_is_made_from_short_ones(monkeypatch):
    """GRPO's generate() of 24 tokens from runs generating 8 and 9 (memplan.replay.decode), checked against one of
    12 first: the same events as the run that generates all 24 (GPT-2 LoRA)."""
    from memplan.replay import decode, synth
    from memplan.runtime.allocator import replayed

    monkeypatch.setattr(decode, "MIN_TOKENS", 16)
    monkeypatch.setattr(decode, "_verified", {})
    setup = Setup(trainer="grpo", technique="lora", precision="bf16-mixed", grad_ckpt=True, batch_size=4, seq_len=64,
                  attn_impl="sdpa", padded=True, max_completion_length=24, num_generations=4)
    made = _events("openai-community/gpt2", setup, synthesize=True)
    assert list(decode._verified.values()) == [True]
    whole = _events("openai-community/gpt2", setup, synthesize=False)
    assert synth.canonical(synth.through_last_step(made)) == synth.canonical(synth.through_last_step(whole))
    a, b = replayed(made), replayed(whole)
    assert (a.peak_reserved, a.phase_allocated) == (b.peak_reserved, b.phase_allocated)


def test_seq2seq_two_stacks_and_a_first_block_of_its_own():
    """T5: encoder and decoder stacks, block 0 holds the relative position bias."""
    from memplan.replay import synth
    from memplan.model.catalog import load_spec

    setup = Setup(technique="full", precision="bf16-mixed", batch_size=2, seq_len=64, attn_impl="eager")
    made = synth.events(load_spec("google-t5/t5-base"), setup, 3)
    assert made is not None
    whole = _events("google-t5/t5-base", setup, synthesize=False)
    assert synth.canonical(synth.through_last_step(made)) == synth.canonical(synth.through_last_step(whole))


def test_blocks_of_different_kinds_are_traced_whole():
    """freeze of 4 blocks: the cut's template block trains, the full model's block 2 does not."""
    from memplan.replay import synth
    from memplan.model.catalog import load_spec

    setup = Setup(technique="freeze", trainable=4, batch_size=1, seq_len=64)
    assert synth.events(load_spec("openai-community/gpt2"), setup, 3) is None


def test_a_model_of_few_blocks_is_traced_whole():
    from memplan.replay import synth
    from memplan.model.catalog import load_spec
    assert synth.events(load_spec("google-t5/t5-small"), Setup(batch_size=1, seq_len=64), 3) is None  # 6 blocks


def test_a_broken_synthesis_is_caught_by_the_canonical_comparison():
    """The check can fail: dropping one copy's events changes the canonical stream."""
    from memplan.replay import synth
    from memplan.model.catalog import load_spec

    setup = Setup(technique="full", precision="fp32", batch_size=1, seq_len=64)
    made = synth.events(load_spec("openai-community/gpt2"), setup, 3)
    assert made is not None
    broken = [e for e in made if not (isinstance(e[0], tuple) and e[0][1:] == (5,))]
    assert len(broken) < len(made)
    assert synth.canonical(synth.through_last_step(broken)) != synth.canonical(synth.through_last_step(made))


def test_a_failing_cut_trace_falls_back_to_the_whole_trace(monkeypatch):
    from memplan.replay import synth
    from memplan.model.catalog import load_spec

    def broken(*args, **kwargs):
        raise RuntimeError("a cut the tracer cannot run")
    monkeypatch.setattr(synth, "cut_run", broken)
    monkeypatch.setattr(synth, "_verified", {})
    setup = Setup(technique="lora", precision="bf16", batch_size=1, seq_len=32)
    assert synth.events(load_spec("openai-community/gpt2"), setup, 3) is None
    assert len(_events("openai-community/gpt2", setup, synthesize=True)) > 0  # traced whole instead
