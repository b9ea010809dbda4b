"""Code paths that depend on the transformers release estimated for (memplan.libs.assume): the loss's shifted logits
before 4.49, T5's sdpa support and fp32 eager softmax before 5.15. Golden numbers come from `memplan trace` run with
transformers 4.48.1 and peft 0.13.2 installed (the tracer runs the real library code on fake tensors)."""
from __future__ import annotations

import pytest

from memplan import libs
from memplan.errors import MemplanError
from memplan.estimator.breakdown import estimate
from memplan.estimator.memory.context import resolve
from memplan.estimator.memory.logits import logits_forward_bytes
from memplan.gpus import cublas_workspace_bytes
from memplan.model.catalog import load_spec
from memplan.setup import Setup

GiB = 2**30

#: fms-acceleration row F03's setup (shared/reference: Mistral-7B LoRA r16 on q,k,v,o, bf16, AdamW, b4 s4096,
#: checkpointing); flash_attention_2 there, sdpa here (the tracer cannot run flash-attn; with checkpointing the
#: kernel does not set the peak).
F03 = dict(technique="lora", precision="bf16", lora_r=16, lora_alpha=16, optimizer="adamw", batch_size=4,
           seq_len=4096, grad_ckpt=True, attn_impl="sdpa", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_loss_shifted_logits_before_4_49_set_the_forward_peak():
    """transformers 4.48.1 ForCausalLMLoss copies the logits shifted (`logits[..., :-1, :].contiguous()`): traced
    24.88 GiB at the end of the forward (F03 measured 24.87 GiB on an A100 with 4.48.1); from 4.49 the labels are
    shifted and the peak is the loss's backward (traced 23.82 GiB with 5.23)."""
    with libs.assume(transformers="4.48.1"):
        old = estimate("mistralai/Mistral-7B-v0.1", Setup(**F03))
    with libs.assume(transformers="4.49.0"):
        new = estimate("mistralai/Mistral-7B-v0.1", Setup(**F03))
    traced_old, traced_new = 24.88 * GiB, 23.82 * GiB
    workspace = cublas_workspace_bytes(training=True)  # only CUDA allocates it: not in a trace
    assert old.peak_phase == "forward" and new.peak_phase == "backward_start"
    assert abs(old.peak_allocated_bytes - workspace - traced_old) / traced_old < 0.01
    assert abs(new.peak_allocated_bytes - workspace - traced_new) / traced_new < 0.01


def test_shifted_copy_dtype_per_family():
    """Before 4.49 Llama-like families upcast then shift (fp32 copy); GPT-2 shifts its own bf16 logits and runs
    CrossEntropyLoss on them without an upcast (modeling_gpt2.py 4.48.1 GPT2LMHeadModel.forward)."""
    fields = dict(technique="lora", precision="bf16", batch_size=2, seq_len=128)
    llama = resolve(load_spec("meta-llama/Llama-3.2-1B"), Setup(**fields))
    gpt2 = resolve(load_spec("openai-community/gpt2"), Setup(**fields))
    t = 2 * 128
    with libs.assume(transformers="4.48.1"):
        assert logits_forward_bytes(llama) == t * llama.vocab * (2 + 4 + 4 + 4)
        assert logits_forward_bytes(gpt2) == t * gpt2.vocab * (2 + 2 + 2)
    with libs.assume(transformers="5.23.0"):
        assert logits_forward_bytes(llama) == t * llama.vocab * (2 + 4 + 4)
        assert logits_forward_bytes(gpt2) == t * gpt2.vocab * (2 + 4 + 4)
    # one sequence: the slice of [1, s, vocab] is contiguous already, `.contiguous()` copies nothing
    single = resolve(load_spec("meta-llama/Llama-3.2-1B"), Setup(**{**fields, "batch_size": 1}))
    with libs.assume(transformers="4.48.1"):
        assert logits_forward_bytes(single) == 128 * single.vocab * (2 + 4 + 4)


def test_t5_sdpa_from_5_15():
    """T5 gained sdpa in transformers 5.15: before it the default is eager and an sdpa setup is refused with the
    release named; t5-base LoRA r64 bf16 b16 s256 traced 7.85 GiB on 4.48.1 (fp32 eager softmax, -11.6% before)."""
    setup = Setup(technique="lora", precision="bf16", lora_r=64, batch_size=16, seq_len=256)
    with libs.assume(transformers="4.48.1"):
        est = estimate("google-t5/t5-base", setup)
        assert "attention: eager" in est.notes
        with pytest.raises(MemplanError, match="before transformers 5.15"):
            estimate("google-t5/t5-base", Setup(technique="lora", attn_impl="sdpa"))
    traced = 7.85 * GiB
    assert abs(est.peak_allocated_bytes - cublas_workspace_bytes(training=True) - traced) / traced < 0.02
    with libs.assume(transformers="5.15.0"):
        assert "attention: sdpa" in estimate("google-t5/t5-base", setup).notes


def test_causal_mask_buffers_of_older_releases():
    """GPT-2 (until 5.1) and GPT-NeoX (until 4.48) registered a [max_positions, max_positions] bool causal mask on
    every attention layer; the tracer on 4.48.1 found pythia-1b's weights 64 MiB (16 x 2048^2 bytes) above the
    estimate, its QLoRA ckpt peak -3.9% before (-0.03% after)."""
    from memplan.estimator.memory.weights import release_buffer_bytes, weights_bytes
    fields = dict(technique="lora", precision="bf16", batch_size=2, seq_len=128)
    pythia = resolve(load_spec("EleutherAI/pythia-1b"), Setup(**fields))
    gpt2 = resolve(load_spec("openai-community/gpt2"), Setup(**fields))
    current = weights_bytes(pythia)
    with libs.assume(transformers="4.48.1"):
        assert release_buffer_bytes(pythia) == 16 * 2048**2
        assert weights_bytes(pythia) == current + 16 * 2048**2  # not served from the per-model memo
        assert release_buffer_bytes(gpt2) == 12 * 1024**2
    with libs.assume(transformers="5.1.0"):
        assert release_buffer_bytes(pythia) == 0 and release_buffer_bytes(gpt2) == 12 * 1024**2
    with libs.assume(transformers="5.2.0"):
        assert release_buffer_bytes(gpt2) == 0 and weights_bytes(pythia) == current


GPT2_EAGER = 1389193216  # gpt2 LoRA fp32 b4 s128 eager, transformers 4.48.1


@pytest.mark.parametrize("model, fields, traced", [
    # transformers 4.48.1 sdpa_attention_forward copies q, k, v (.contiguous()) while the training DynamicCache
    # holds the rotated K and the fused qkv_proj output V is a view of, to the loss: 32 x 48 MiB (-7.2% before)
    ("microsoft/Phi-3-mini-4k-instruct", dict(lora_targets=("qkv_proj",)), 17227672064),
    # before 4.54 grouped K/V reach the kernel repeated to every head; before 4.53 a padded batch's mask is one
    # float [b, 1, q, k] tensor shared by every layer (-2.3% unpadded, +1.4% padded before)
    ("meta-llama/Llama-3.2-1B", dict(padded=True), 8869108224),
    # eager too: torch.matmul copies GPT-2's transposed q/k/v heads while the cache's k/v views keep c_attn's output
    # (-4.1% before; traced on the whole model)
    ("openai-community/gpt2", dict(precision="fp32", batch_size=4, seq_len=128, attn_impl="eager"), GPT2_EAGER),
])
def test_attention_integration_before_4_56(model, fields, traced):
    """Traced with transformers 4.48.1 and peft 0.13.2 (`memplan trace`; LoRA bf16 b1 s2048 sdpa unless given)."""
    from memplan.tracer.training import comparable_estimate_bytes
    setup = Setup(**{**dict(technique="lora", precision="bf16", batch_size=1, seq_len=2048, attn_impl="sdpa"),
                     **fields})
    with libs.assume(transformers="4.48.1"):
        est = comparable_estimate_bytes(estimate(model, setup))
    assert abs(est - traced) / traced < 0.005


@pytest.mark.parametrize("release, fields, traced, merged", [
    ("4.48.1", dict(technique="lora", precision="bf16-mixed"), 8973924864, 3),
    ("4.48.1", dict(technique="full", precision="bf16"), 6029613568, 3),
    # transformers 5 builds no encoder mask for an unpadded batch: the decoder's bias alone is merged (+9.6% with 3)
    ("5.8.1", dict(technique="lora", precision="bf16-mixed"), 8181062144, 1),
])
def test_t5_passes_its_bias_plus_mask_before_5_15(release, fields, traced, merged):
    """Before 5.15 T5's first layer returns position_bias + mask, [b, heads, q, k], which every later layer's checkpoint
    keeps (4.x: the encoder's and the cross-attention's zero bias + encoder mask too): t5-base eager b32 s512
    checkpointed, traced with that release (4.48.1 with peft 0.13.2; `memplan trace --layers 2`; -13.3% and -9.9%
    before on 4.48.1). From 5.15 the bias is passed alone: [1, heads, q, k] per stack."""
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.stacks import checkpoint_inputs_bytes
    from memplan.tracer.training import comparable_estimate_bytes
    setup = Setup(**fields, batch_size=32, seq_len=512, attn_impl="eager", grad_ckpt=True)
    with libs.assume(transformers=release):
        est = comparable_estimate_bytes(estimate("google-t5/t5-base", setup))
        held = checkpoint_inputs_bytes(resolve(load_spec("google-t5/t5-base"), setup))
    assert abs(est - traced) / traced < 0.005
    with libs.assume(transformers="5.15.0"):
        alone = checkpoint_inputs_bytes(resolve(load_spec("google-t5/t5-base"), setup))
    r = 4 if fields["precision"] == "bf16-mixed" else 2
    encoder_output, bias = 32 * 512 * 768 * r, 512 * 512 * 12 * r
    assert alone - encoder_output == 2 * bias
    assert held - encoder_output == merged * 32 * bias + (2 - min(merged, 2)) * bias


def test_sdpa_integration_rules_leave_own_attention_code_alone():
    """Falcon had its own sdpa code in 4.48.1 (no ALL_ATTENTION_FUNCTIONS): no repeat, copy or shared-mask rule."""
    from memplan.estimator.memory.attention import GQA_IN_SDPA_SINCE, sdpa_integration_before
    with libs.assume(transformers="4.48.1"):
        falcon = resolve(load_spec("tiiuae/falcon-7b"), Setup(attn_impl="sdpa"))
        llama = resolve(load_spec("meta-llama/Llama-3.2-1B"), Setup(attn_impl="sdpa"))
        assert not sdpa_integration_before(falcon, GQA_IN_SDPA_SINCE)
        assert sdpa_integration_before(llama, GQA_IN_SDPA_SINCE)
    with libs.assume(transformers="4.56.0"):
        assert not sdpa_integration_before(resolve(load_spec("meta-llama/Llama-3.2-1B"), Setup(attn_impl="sdpa")),
                                           GQA_IN_SDPA_SINCE)
