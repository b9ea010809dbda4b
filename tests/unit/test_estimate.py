"""Estimator tests: hand-derived component numbers on a hand-built tiny Llama (tests/conftest.py), phase logic,
and properties (hypothesis) that must hold for any model and setup."""
from __future__ import annotations

import dataclasses
from pathlib import Path
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.estimator.breakdown import estimate
from memplan.gpus import cublas_workspace_bytes

CUBLAS_WORKSPACE_BYTES = cublas_workspace_bytes(training=True)  # two threads (forward, autograd) x 32 MiB
from memplan.estimator.memory.optimizer import bnb8_state_bytes
from memplan.estimator.memory.weights import NF4_BLOCK, nf4_state_bytes
from memplan.setup import Setup

TOTAL = 202_048  # tiny_llama numel: 2 x 64,000 (embed, lm_head) + 2 x 36,992 (layers) + 64 (final norm)


def test_weights_and_adamw_fp32_full(tiny):
    e = estimate(tiny, technique="full", precision="fp32", optimizer="adamw", batch_size=1, seq_len=8)
    c = e.components if e.peak_phase == "optimizer_step" else None
    assert e.params_total == TOTAL and e.params_trainable == TOTAL
    step = estimate(tiny, technique="full", precision="fp32", optimizer="adamw", batch_size=1, seq_len=8)
    # optimizer_step phase: weights 4 B + grads 4 B + exp_avg/exp_avg_sq 8 B + foreach sqrt buffer 4 B per param
    assert step.phases["optimizer_step"] == TOTAL * (4 + 4 + 8 + 4) + CUBLAS_WORKSPACE_BYTES
    assert c is None or c["optimizer_temporaries"] == TOTAL * 4


def test_lora_pure_bf16_hand_derived(tiny):
    # LoRA r=8 on peft's llama defaults q_proj, v_proj; weights bf16; batch 2 x seq 8 = 16 tokens; sdpa.
    e = estimate(tiny, technique="lora", precision="bf16", batch_size=2, seq_len=8, attn_impl="sdpa")
    lora_params = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # r*(in+out) for q (64->64) and v (64->32), 2 layers
    assert e.params_trainable == lora_params == 3_584
    comp = e.components
    assert comp["weights"] == TOTAL * 2
    assert comp["lora_adapters"] == lora_params * 4  # peft upcasts adapters to fp32
    assert comp["optimizer_state"] == lora_params * 8  # AdamW m, v in fp32
    # Per block per token: 2 RMSNorms x (fp32 input 4h = 256 + rsqrt's fp32 output 4: derivatives.yaml rsqrt saves
    # its result) + 2 LoRA branches x (fp32 copy 4h + [t,r] fp32 32) + sdpa q,k,v,out (2*64 + 2*32)*2 B + logsumexp
    # 4 heads x 4 B + SwiGLU gate/up/act 3 x 128 x 2 B = 2,264 B.
    per_block = 16 * (2 * 260 + 2 * (256 + 32) + ((2 * 64 + 2 * 32) * 2 + 16) + 768)
    # Embeddings are frozen: block 0's input norm runs before any adapter and saves nothing.
    first_norm = 16 * 260
    final_norm = 16 * 260
    assert comp["activations"] == 2 * per_block - first_norm + final_norm == 72_448
    # Peak at the start of backward: saved log_softmax + two fp32 grads of [16 tokens, 1000 vocab].
    assert e.peak_phase == "backward_start"
    assert comp["logits"] == 12 * 16 * 1000
    assert e.peak_allocated_bytes == TOTAL * 2 + lora_params * (4 + 8) + 72_448 + 192_000 + CUBLAS_WORKSPACE_BYTES


def test_bnb_8bit_state_rule():
    # bitsandbytes Optimizer2State.init_state: uint8 state1/state2 + fp32 absmax per 256 block; < 4096 elems -> fp32.
    assert bnb8_state_bytes((4096,), 4) == 2 * (4096 + 16 * 4)
    assert bnb8_state_bytes((64, 63), 4) == 2 * 64 * 63 * 4


def test_qlora_nf4_weights_and_state(tiny):
    plain = estimate(tiny, technique="qlora", precision="bf16", batch_size=1, seq_len=8)
    dq = estimate(tiny, technique="qlora", precision="bf16", double_quant=True, batch_size=1, seq_len=8)
    quantized = 2 * 36_864  # every block Linear; lm_head stays unquantized
    others = TOTAL - quantized
    # prepare_model_for_kbit_training keeps non-quantized params in fp32; 4-bit packs two weights per byte.
    assert plain.components["weights"] == others * 4 + quantized // 2
    # fp32 absmax per 64 weights, each tensor's allocation rounded up to 512 B by the caching allocator
    per_tensor = [max(512, n // NF4_BLOCK * 4) for n in (4096, 2048, 2048, 4096, 8192, 8192, 8192)] * 2
    assert plain.components["quant_state"] == sum(per_tensor)
    assert dq.components["quant_state"] > 0


def test_double_quant_metadata_4096x4096():
    # QLoRA paper sec. 3 (arXiv:2305.14314): absmax 32 bit per 64 weights -> 8 bit + 32 bit per 256 blocks.
    n = 4096 * 4096
    assert nf4_state_bytes(n, False) == n // 64 * 4  # 1 MiB
    assert nf4_state_bytes(n, True) == n // 64 + (n // 64 // 256) * 4 + 512


def test_grad_accum_keeps_gradients_in_forward(tiny):
    one = estimate(tiny, precision="bf16", batch_size=2, seq_len=8)
    four = estimate(tiny, precision="bf16", batch_size=2, seq_len=8, grad_accum=4)
    assert four.phases["forward"] - one.phases["forward"] == TOTAL * 2


def test_paged_optimizer_outside_allocator(tiny):
    e = estimate(tiny, technique="lora", optimizer="paged-adamw-8bit", batch_size=1, seq_len=8)
    assert e.components["optimizer_state"] == 0
    assert e.components["paged_optimizer_state"] > 0
    assert e.device_total_bytes > e.peak_reserved_bytes + e.components["cuda_context"]


def test_inference_kv_cache(tiny):
    e = estimate(tiny, mode="infer", precision="bf16", batch_size=2, prompt_len=10, new_tokens=5)
    # DynamicCache: 2 layers x K,V x [b=2, kv_heads=2, 10 + 5 - 1, 16] x 2 B
    kv = 2 * 2 * 2 * 2 * 14 * 16 * 2
    assert e.phases["decode"] >= TOTAL * 2 + kv
    assert e.params_trainable == 0


def test_errors_are_reported_together(tiny):
    from memplan.errors import BadInput
    with pytest.raises(BadInput) as info:
        estimate(tiny, seq_len=5000, target_len=4)
    msg = str(info.value)
    assert "max_position_embeddings" in msg and "target_len" in msg


def test_estimate_module_is_torch_free():
    code = "import memplan.estimator.breakdown, memplan.setup, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------- properties ----------
techniques = st.sampled_from(["full", "lora", "qlora", "freeze"])
precisions = st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16"])
optimizers = st.sampled_from(["adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd"])
attn = st.sampled_from(["eager", "sdpa"])


def _setup(technique, precision, optimizer, impl, ckpt, batch, seq):
    return Setup(technique=technique, precision=precision, optimizer=optimizer, attn_impl=impl, grad_ckpt=ckpt,
                 batch_size=batch, seq_len=seq)


@settings(max_examples=150, deadline=None)
@given(techniques, precisions, optimizers, attn, st.booleans(), st.integers(1, 32), st.integers(1, 2048))
def test_monotone_in_batch_and_seq(technique, precision, optimizer, impl, ckpt, batch, seq):
    from tests.conftest import tiny_llama
    spec = tiny_llama()
    base = estimate(spec, _setup(technique, precision, optimizer, impl, ckpt, batch, seq))
    more_b = estimate(spec, _setup(technique, precision, optimizer, impl, ckpt, batch + 1, seq))
    more_s = estimate(spec, _setup(technique, precision, optimizer, impl, ckpt, batch, seq + 1))
    for field in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        assert getattr(more_b, field) >= getattr(base, field)
        assert getattr(more_s, field) >= getattr(base, field)


@settings(max_examples=100, deadline=None)
@given(techniques, precisions, optimizers, attn, st.integers(1, 16), st.integers(1, 1024))
def test_checkpointing_never_adds_activations(technique, precision, optimizer, impl, batch, seq):
    from tests.conftest import tiny_llama
    spec = tiny_llama()
    off = estimate(spec, _setup(technique, precision, optimizer, impl, False, batch, seq))
    on = estimate(spec, _setup(technique, precision, optimizer, impl, True, batch, seq))
    assert on.phases["forward"] <= off.phases["forward"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["openai-community/gpt2", "meta-llama/Llama-3.2-1B", "google-t5/t5-small"]),
       precisions, optimizers, attn, st.booleans(), st.integers(1, 16), st.integers(1, 1024))
def test_lora_never_exceeds_full(model, precision, optimizer, impl, ckpt, batch, seq):
    # On real models (not the tiny spec, whose weights are smaller than one batch of activations: there LoRA's
    # fp32 input copies can legitimately outweigh full fine-tuning's gradients) LoRA holds no more than full
    # fine-tuning beyond what only it has: its adapters, their optimizer state and, under checkpointing, the frozen
    # embeddings' output leaf (stacks.embedding_leaf_bytes). Traced: GPT-2 fp32 SGD eager b3 s415 checkpointed, LoRA
    # 1245.9 MiB against full fine-tuning's 1244.7 (a stateless optimizer, no gradient held at the loss).
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.stacks import embedding_leaf_bytes
    from memplan.model.catalog import load_spec
    spec = load_spec(model)
    full = estimate(spec, _setup("full", precision, optimizer, impl, ckpt, batch, seq))
    lora_setup = _setup("lora", precision, optimizer, impl, ckpt, batch, seq)
    lora = estimate(spec, lora_setup)
    own = lora.components.get("lora_adapters", 0) + lora.components.get("optimizer_state", 0) + \
        embedding_leaf_bytes(resolve(spec, lora_setup))
    # device totals: with a paged optimizer full fine-tuning's state sits outside the allocator
    assert lora.device_total_bytes <= full.device_total_bytes + own


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["bf16", "fp16"]), st.integers(1, 8), st.integers(1, 512))
def test_quantized_weights_order(precision, batch, seq):
    from tests.conftest import tiny_llama
    spec = tiny_llama()
    w = {q: estimate(spec, mode="infer", precision=precision, quant=q, batch_size=batch, prompt_len=seq,
                     new_tokens=1).components["weights"] for q in ("nf4", "int8", None)}
    assert w["nf4"] <= w["int8"] <= w[None]


# ---------------------------------------------------------------- inference and dropout terms found on the H100
# Measured live sets: benchmarks/diagnose/cases-3.yaml on an H100 (session 8); the rows are gated in
# data/measured/gpu-h100.csv. Here the terms are checked by hand from their definitions (exact, no tolerance).

def _ctx(model: str, **fields):
    from memplan.estimator.memory.context import resolve
    from memplan.model.catalog import load_spec
    return resolve(load_spec(model), Setup(**fields))


def test_prefill_mlp_working_set_gpt2_gelu_new():
    """gpt2 bf16 b8 s512 prefill: 5 hidden-sized tensors (4 + GPT2Block's attn_output) and 4 intermediate-sized
    ones (fc1 out + NewGELU's three temporaries), 2 bytes each, over 4096 tokens."""
    from memplan.estimator.memory.inference import prefill_working_bytes
    ctx = _ctx("openai-community/gpt2", mode="infer", precision="bf16", batch_size=8, prompt_len=512, attn_impl="sdpa")
    assert prefill_working_bytes(ctx) == (5 * 768 + 4 * 3072) * 2 * 8 * 512


def test_generate_prompt_pass_holds_batch_sized_positions():
    """generate() passes [b, s] position_ids (made from the attention mask), so GPT-2's wpe returns [b, s, hidden] in
    its prompt pass, which validate measures in the decode phase (H100 gpt2 bf16 b8 s512: 5.57 MB above the plain
    prefill, [7, 512, 768] bf16 = 5.5 MB); rotary models (Llama) and encoder-decoders add nothing, nor a run without
    new tokens."""
    from memplan.estimator.breakdown import estimate
    from memplan.estimator.memory.inference import generate_position_bytes
    fields = dict(mode="infer", precision="bf16", batch_size=8, prompt_len=512, attn_impl="sdpa")
    ctx = _ctx("openai-community/gpt2", **fields)
    assert generate_position_bytes(ctx) == 8 * 512 * 768 * 2
    assert generate_position_bytes(_ctx("openai-community/gpt2", **{**fields, "new_tokens": 0})) == 0
    assert generate_position_bytes(_ctx("meta-llama/Llama-3.2-1B", **fields)) == 0
    assert generate_position_bytes(_ctx("google-t5/t5-base", **fields)) == 0
    e = estimate("openai-community/gpt2", Setup(**fields))
    assert e.peak_phase == "decode" and e.phases["decode"] - e.phases["prefill"] == 8 * 512 * 768 * 2


def test_seq2seq_prompt_pass_caches_nothing():
    from memplan.estimator.memory.inference import kv_cache_bytes, prompt_cache_bytes
    t5 = _ctx("google-t5/t5-base", mode="infer", precision="bf16", batch_size=8, seq_len=512)
    assert prompt_cache_bytes(t5) == 0 and kv_cache_bytes(t5) > 0
    llama = _ctx("meta-llama/Llama-3.2-1B", mode="infer", precision="bf16", batch_size=1, prompt_len=512,
                 new_tokens=512, attn_impl="sdpa")
    assert prompt_cache_bytes(llama) == kv_cache_bytes(llama) // 2


def test_activation_dropout_mask_counted():
    """bart-large (activation_dropout 0.1) saves a bool [tokens, intermediate] mask per layer beside what the same
    model without activation dropout saves: 24 layers x 4096 tokens x 4096 bytes."""
    import dataclasses

    from memplan.estimator.memory import activations
    ctx = _ctx("facebook/bart-large", technique="lora", precision="bf16", lora_r=64, batch_size=16, seq_len=256,
               attn_impl="sdpa")
    assert ctx.spec.arch.act_dropout == 0.1
    arch0 = dataclasses.replace(ctx.spec.arch, act_dropout=0.0)
    ctx0 = dataclasses.replace(ctx, spec=dataclasses.replace(ctx.spec, arch=arch0))
    saved = lambda c: sum(full for full, _ in activations.per_block_bytes(c))  # noqa: E731
    assert saved(ctx) - saved(ctx0) == 24 * 16 * 256 * 4096


def test_qwen2_moe_shared_expert_gate_lora_saves_its_input():
    """Qwen2-MoE's shared_expert_gate reads the shared expert's input (layout "mlp_gate"): its LoRA branch saves a
    [tokens, hidden] fp32 cast of it on a bf16 base (peft lora/layer.py Linear.forward `_cast_input_dtype`) and lora_B
    [tokens, r]; on an fp32 base the input is the tensor gate_proj's branch already saved, only [tokens, r] is new.
    6 blocks x 512 tokens, hidden 512, r 8 (the tracer's -1.6% on the sdpa row)."""
    from pathlib import Path

    from memplan.estimator.memory import activations
    shape = str(Path(__file__).resolve().parents[2] / "benchmarks" / "shapes" / "qwen2_moe" / "config.json")
    without = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    saved = lambda c: sum(full for full, _ in activations.per_block_bytes(c))  # noqa: E731
    kw = dict(technique="lora", batch_size=2, seq_len=256, attn_impl="sdpa")
    bf16 = [_ctx(shape, precision="bf16", lora_targets=t, **kw) for t in ("all-linear", without)]
    assert saved(bf16[0]) - saved(bf16[1]) == 6 * 512 * (512 * 4 + 8 * 4)
    fp32 = [_ctx(shape, precision="fp32", lora_targets=t, **kw) for t in ("all-linear", without)]
    assert saved(fp32[0]) - saved(fp32[1]) == 6 * 512 * 8 * 4


def test_autocast_caches_the_lora_adapter_copies():
    """QLoRA trains under autocast: lora_A and lora_B are fp32 trainable leaves, so each forward casts them to bf16
    and autocast's cache keeps the copies until the forward ends, checkpointing or not. Llama-3-8B all-linear: 7
    Linears per block with in + out = 81,920 summed, 32 blocks, 2 bytes per element (the lm_head's cast is the same
    for every rank)."""
    from memplan.estimator.memory.quant import autocast_copy_bytes
    kw = dict(technique="qlora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=1024,
              attn_impl="sdpa", grad_ckpt=True)
    r256 = autocast_copy_bytes(_ctx("meta-llama/Meta-Llama-3-8B", lora_r=256, **kw))
    r8 = autocast_copy_bytes(_ctx("meta-llama/Meta-Llama-3-8B", lora_r=8, **kw))
    assert r256 - r8 == (256 - 8) * 81_920 * 32 * 2
    # pure bf16 LoRA has no autocast: peft casts the input to the adapters' fp32 instead
    assert autocast_copy_bytes(_ctx("meta-llama/Meta-Llama-3-8B", technique="lora", precision="bf16",
                                    lora_r=256, lora_targets="all-linear")) == 0


def test_training_forward_holds_the_dynamic_cache_copies():
    """Without checkpointing the training forward builds a DynamicCache whose torch.cat copies of K and V live until
    the loss: extra where the attention does not save those tensors (QLoRA's fp32 projections are cast to bf16 for
    the kernel; frozen blocks save nothing), free where it does. Llama-2-7b: 32 layers, K+V = 2 x 4096 per token."""
    from memplan.estimator.memory.recording import graph_blocks
    from memplan.estimator.memory.inference import training_cache_bytes
    tokens = 2 * 512
    qlora = _ctx("meta-llama/Llama-2-7b-hf", technique="qlora", precision="bf16", batch_size=2, seq_len=512,
                 attn_impl="sdpa")
    assert training_cache_bytes(qlora) == 32 * tokens * 2 * 4096 * 4
    ckpt = _ctx("meta-llama/Llama-2-7b-hf", technique="qlora", precision="bf16", batch_size=2, seq_len=512,
                attn_impl="sdpa", grad_ckpt=True)
    assert training_cache_bytes(ckpt) == 0  # GradientCheckpointingLayer turns use_cache off
    full = _ctx("meta-llama/Llama-2-7b-hf", technique="full", precision="bf16", batch_size=2, seq_len=512,
                attn_impl="sdpa")
    assert training_cache_bytes(full) == 0  # sdpa saves the cache's own bf16 tensors
    # bf16-mixed: rotary promotes k to the fp32 residual dtype and the cache makes v in k's dtype, so every layer's
    # cache holds fp32 K and V beside the kernel's bf16 casts (inference.rotary_promotes_kv)
    mixed = _ctx("meta-llama/Llama-2-7b-hf", technique="full", precision="bf16-mixed", batch_size=2, seq_len=512,
                 attn_impl="sdpa")
    assert training_cache_bytes(mixed) == 32 * tokens * 2 * 4096 * 4
    freeze = _ctx("meta-llama/Llama-2-7b-hf", technique="freeze", trainable=2, precision="bf16", batch_size=2,
                  seq_len=512, attn_impl="sdpa")
    frozen = 32 - len(graph_blocks(freeze))
    assert frozen > 0 and training_cache_bytes(freeze) == frozen * tokens * 2 * 4096 * 2
    assert estimate_bytes_phase(qlora, "forward", "forward_kv_cache") == training_cache_bytes(qlora)


def estimate_bytes_phase(ctx, phase: str, component: str) -> int:
    from memplan.estimator.phases import training_phases
    return training_phases(ctx)[phase].get(component, 0)


def test_qlora_attention_saves_compute_dtype_casts():
    """Under autocast the attention kernel runs on bf16 casts whatever dtype the projections return, so QLoRA's
    (fp32 projections) saved attention tensors equal LoRA bf16-mixed's, not twice them."""
    from memplan.estimator.memory.attention import attn_core
    kw = dict(precision="bf16", batch_size=2, seq_len=512, attn_impl="sdpa")
    q = _ctx("meta-llama/Llama-3.2-1B", technique="qlora", **kw)
    m = _ctx("meta-llama/Llama-3.2-1B", technique="lora", **{**kw, "precision": "bf16-mixed"})
    assert q.act_bytes == 4 and attn_core(q, 2048, 512, 1, 1, "fused") == attn_core(m, 2048, 512, 1, 1, "fused")


def test_t5_mlp_dropout_uses_dropout_rate():
    """T5DenseActDense applies dropout_rate between relu and wo (a bool mask, and wo's input is no longer relu's
    saved output); OPT's activation_dropout is 0, so its relu output is fc2's input."""
    from memplan.model.catalog import load_spec
    assert load_spec("google-t5/t5-base").arch.act_dropout == 0.1
    assert load_spec("facebook/opt-1.3b").arch.act_dropout == 0.0


def test_t5_freeze_keeps_only_the_decoders_bias_and_caches_the_frozen_blocks():
    """t5-base trained in its last decoder block (bf16-mixed, sdpa, 8 x 512): the frozen encoder records no graph,
    so only the decoder's masks are saved, as autocast's bf16 casts: the cross-attention's zero bias [1, 12, 512,
    512], merged per layer with a padded batch's encoder mask ([8, ...] in the one recorded layer), and the trainable
    block's own self-attention mask (one per recorded layer under transformers >= 5.20; the decoder's all-ones mask
    is skipped: [1, ...]; an encoder layer's takes the padding mask's batch); the 11 frozen decoder blocks'
    EncoderDecoderCache K/V (self over the decoder's 512 tokens, cross over the encoder's 512) live through the
    forward (the tracer's t5-base freeze run held 22 x 2 such tensors)."""
    from memplan import libs
    from memplan.estimator.memory.position_bias import position_bias_bytes, self_bias_mask_bytes
    from memplan.estimator.memory.attention import attention_kernel
    from memplan.estimator.memory.inference import training_cache_bytes
    square = 12 * 512 * 512 * 2
    for padded in (False, True):
        ctx = _ctx("google-t5/t5-base", technique="freeze", precision="bf16-mixed", batch_size=8, seq_len=512,
                   attn_impl="sdpa", padded=padded)
        rows = 8 if padded else 1
        with libs.assume(transformers="5.23.0"):  # fused kernels for T5's bias (attention.MATH_SDPA_UNTIL)
            assert position_bias_bytes(ctx) == rows * square
            kernel = attention_kernel(ctx, relative_bias=True)
            assert kernel == "fused" and self_bias_mask_bytes(ctx, 8, 512, kernel, "decoder") == square
            assert self_bias_mask_bytes(ctx, 8, 512, kernel, "encoder") == rows * square
        with libs.assume(transformers="5.17.0"):  # the math kernel adds the bias to its scores and keeps no mask
            assert self_bias_mask_bytes(ctx, 8, 512, attention_kernel(ctx, relative_bias=True)) == 0
            # the cross bias is merged per sdpa call in every transformers 5 release (create_position_bias_mask):
            # counted [8, ...] unpadded before, the H100 t5-base freeze fp32 row on 5.17 was +2.4% (now -0.3%)
            assert position_bias_bytes(ctx) == rows * square
        assert training_cache_bytes(ctx) == 11 * 2 * 768 * 8 * (512 + 512) * 2


@pytest.mark.slow
def test_public_functions_stay_callable_in_any_import_order():
    """`memplan.estimate(...)` once stopped working after the module of the same name was imported (Python binds a
    loaded submodule over the package's lazy export). The parts are now nouns (estimator, planner, measure, tracer),
    so importing every submodule first leaves every public verb a function."""
    import subprocess
    import sys
    code = ("import importlib, pkgutil, memplan\n"
            "for m in pkgutil.walk_packages(memplan.__path__, 'memplan.'):\n"
            "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
            "for name in ('estimate', 'fit', 'plan', 'validate', 'check', 'diagnose', 'trace', 'load_plan'):\n"
            "    assert callable(getattr(memplan, name)) and not isinstance(getattr(memplan, name), type(memplan)), name\n"
            "for _ in range(2):\n"
            "    memplan.estimate('gpt2'); memplan.fit(memplan.load_spec('gpt2'), memplan.find_gpu('t4'))\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_registered_buffers_are_resident_beside_the_weights():
    """GPT-BigCode registers its causal mask as an [n_positions, n_positions] bool buffer (modeling_gpt_bigcode.py
    GPTBigCodeModel): 64 MiB for StarCoder's 8192 positions, on the GPU with the weights. The tracer counted it
    (santacoder: 4 MiB) before the estimate did."""
    from memplan.model.catalog import load_spec

    spec = load_spec("bigcode/starcoder")
    assert [(b.name, b.shape, b.dtype) for b in spec.buffers] == [("transformer.bias", (8192, 8192), "bool")]
    e = estimate("bigcode/starcoder", mode="infer", precision="bf16", batch_size=1, seq_len=128)
    assert e.components["weights"] == spec.numel_total * 2 + 8192 * 8192


# ---------------------------------------------------------------------------------------------- per-model memo
#: For every Setup field outside memory.context.SELECTION_FIELDS, values that change some estimate. A new Setup
#: field must be added here: the test then checks that no memoized term silently ignores it.
_VARIED = {
    "double_quant": [True], "group_size": [32, -1], "lora_r": [64], "lora_alpha": [32], "lora_dropout": [0.1], "optimizer": ["adamw", "adamw-8bit", "adafactor"],
    "batch_size": [1, 3], "seq_len": [128, 1024], "target_len": [64], "grad_ckpt": [True], "grad_accum": [4],
    "attn_impl": ["eager"], "added_tokens": [100], "prompt_len": [300], "new_tokens": [40], "padded": [True],
    "num_gpus": [2], "num_nodes": [2], "sharding": ["ddp", "zero3", "fsdp-full-shard"], "offload": ["optimizer"],
    "trainer": ["sft", "dpo", "grpo"], "packing": [True], "padding_free": [True], "precompute_ref_log_probs": [True],
    "activation_offloading": [True],
    "num_generations": [4], "max_completion_length": [64], "beta": [0.04], "use_vllm": [True], "vllm_mode": ["server"],
    "vllm_gpu_memory_utilization": [0.5], "steps_per_generation": [2],
}


@pytest.mark.parametrize("model", ["openai-community/gpt2", "google-t5/t5-small", "HuggingFaceTB/SmolLM2-135M"])
def test_memo_never_reuses_a_term_across_setups_it_depends_on(model):
    """Estimates after a warm per-model memo equal estimates from a cold one, for setups that share the selection
    (technique, precision, ...) and differ in one other field each."""
    import dataclasses

    from memplan.errors import BadInput, SetupError
    from memplan.estimator.memory.context import SELECTION_FIELDS, clear_memo

    assert set(_VARIED) | set(SELECTION_FIELDS) == {f.name for f in dataclasses.fields(Setup)}
    bases = [dict(technique="full", precision="bf16-mixed"), dict(technique="lora", precision="bf16"),
             dict(technique="qlora", precision="bf16", quant="nf4"), dict(technique="freeze", precision="fp32"),
             dict(technique="lora", precision="fp16", quant="gptq-int4"),
             dict(mode="infer", precision="bf16")]
    setups = []
    for base in bases:
        for name, values in [("batch_size", [8])] + list(_VARIED.items()):
            for v in values:
                try:
                    setups.append(Setup(**{**base, "seq_len": 256, name: v}))
                except SetupError:
                    pass

    def one(s, cold: bool):
        if cold:
            clear_memo()
        try:
            e = estimate(model, s)
        except BadInput:
            return None
        return e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_total_bytes, e.phases, e.components

    warm = [one(s, cold=False) for s in setups]
    cold = [one(s, cold=True) for s in setups]
    assert len(setups) > 90 and sum(x is not None for x in cold) > 60
    for s, w, c in zip(setups, warm, cold):
        assert w == c, s


def test_added_tokens_grow_only_the_vocabulary_rows_that_exist_and_train():
    """resize_token_embeddings adds one row per token to the input embedding and an untied lm_head: their weights,
    and, where they train, their gradients and Adam state (2 fp32 moments) grow by those rows; a frozen embedding
    (layer freezing) gains no trainable rows."""
    from memplan.estimator.memory import optimizer, weights
    from memplan.estimator.memory.context import resolve
    from memplan.model.catalog import load_spec

    spec = load_spec("meta-llama/Llama-2-7b-hf")  # untied: embed_tokens and lm_head, 4096 wide
    rows = 100 * 4096 * 2  # elements added: 100 rows in each of the two matrices
    for technique, trains in (("full", True), ("freeze", False)):
        s0 = Setup(technique=technique, precision="fp32", optimizer="adamw")
        s1 = dataclasses.replace(s0, added_tokens=100)
        c0, c1 = resolve(spec, s0), resolve(spec, s1)
        assert weights.weights_bytes(c1) - weights.weights_bytes(c0) == rows * 4
        assert weights.trainable_numel(c1) - weights.trainable_numel(c0) == (rows if trains else 0)
        assert optimizer.optimizer_state_bytes(c1) - optimizer.optimizer_state_bytes(c0) == (2 * rows * 4 if trains else 0)


def test_lora_dropout_on_fused_experts_is_refused_like_peft_does():
    """peft adapts Mixtral's router and fused experts as parameters (lora.ParamWrapper), which raise on
    lora_dropout != 0; the attention's Linears take dropout."""
    from memplan.errors import BadInput

    with pytest.raises(BadInput, match="--lora-dropout 0"):
        estimate("mistralai/Mixtral-8x7B-v0.1", Setup(technique="lora", precision="bf16", lora_targets="all-linear",
                                                      lora_dropout=0.05))
    assert estimate("mistralai/Mixtral-8x7B-v0.1", Setup(technique="lora", precision="bf16",
                                                         lora_targets="q_proj,v_proj", lora_dropout=0.05))


def test_added_tokens_tie_a_checkpoints_own_t5_head_again_from_transformers_5():
    """transformers 5 forces T5/mT5's tie_word_embeddings; from_pretrained keeps mt0-xxl's own lm_head, and
    resize_token_embeddings ends with tie_weights(), which ties it (memory.context._resized_spec): with added tokens
    one [vocab, hidden] table fewer, said in the notes; transformers 4.x respects the config and keeps it."""
    from memplan import libs

    s0 = Setup(technique="full", precision="bf16", optimizer="adafactor", batch_size=1, seq_len=128)
    s1 = dataclasses.replace(s0, added_tokens=3)
    table = 250_112 * 4096 * 2  # mt0-xxl's vocabulary x d_model, bf16
    e0, e1 = estimate("bigscience/mt0-xxl", s0), estimate("bigscience/mt0-xxl", s1)
    rows = 3 * 4096 * 2  # the added rows of the one remaining table
    assert e0.components["weights"] - e1.components["weights"] == table - rows
    assert any("ties this checkpoint's own lm_head" in n for n in e1.notes)
    with libs.assume(transformers="4.57.6"):
        e4 = estimate("bigscience/mt0-xxl", s1)
    assert e4.components["weights"] - e0.components["weights"] == 2 * rows
    assert not any("ties this checkpoint's own lm_head" in n for n in e4.notes)


@pytest.mark.parametrize("model, fields, per_logit", [
    # CUDA autocast has no cross_entropy_loss entry: a bf16 log_softmax (kept), nll_loss's fp32 cast (kept) and its
    # fp32 gradient (H100, transformers 5.17: t5-base bf16-mixed freeze b8 s512 +7.8% -> -1.0% with this)
    ("google-t5/t5-base", dict(precision="bf16-mixed"), 2 + 4 + 4),
    ("google-bert/bert-large-uncased", dict(precision="bf16-mixed"), 2 + 4 + 4),
    # BART adds its fp32 final_logits_bias first: fp32 logits, an fp32 log_softmax and two fp32 gradients
    ("facebook/bart-large", dict(precision="bf16-mixed"), 3 * 4),
    # under QLoRA the buffer is bf16 (k-bit preparation casts parameters only): the 16-bit loss again
    ("facebook/bart-large", dict(technique="qlora", precision="bf16"), 2 + 4 + 4),
    # loss_function upcasts the logits first (Llama): three fp32 buffers
    ("meta-llama/Llama-3.2-1B", dict(precision="bf16-mixed"), 3 * 4),
    # a 16-bit model without autocast keeps the 16-bit loss throughout
    ("google-t5/t5-base", dict(precision="bf16"), 3 * 2),
])
def test_loss_backward_buffers_follow_cuda_autocast(model, fields, per_logit):
    """Peak of the loss's backward per logit element (memory.logits.logits_backward_bytes), by head and precision."""
    from memplan.estimator.memory.logits import logits_backward_bytes
    ctx = _ctx(model, batch_size=4, seq_len=256, **fields)
    assert logits_backward_bytes(ctx) == 4 * 256 * ctx.vocab * per_logit


def test_sliding_window_mask_from_the_window_length_on():
    """masking_utils _ignore_causal_mask_sdpa keeps a sliding-window mask once kv_length >= the window: Mistral-7B
    (window 4096) at exactly 4096 tokens gets the mask, at 4095 is_causal (the tracer's QLoRA b4 s4096 held it)."""
    from memplan.estimator.memory.attention import windowed
    at = _ctx("mistralai/Mistral-7B-v0.1", technique="qlora", precision="bf16", batch_size=1, seq_len=4096,
              attn_impl="sdpa")
    below = _ctx("mistralai/Mistral-7B-v0.1", technique="qlora", precision="bf16", batch_size=1, seq_len=4095,
                 attn_impl="sdpa")
    assert windowed(at) and not windowed(below)


def test_fused_qkv_output_pinned_by_the_v_view():
    """ModernBERT's Wqkv [hidden -> 3 x hidden] with rotary q/k: sdpa saves V, a view of the whole output (traced:
    a ModernBERT-shaped config full bf16 b2 s512 -2.2% before). A causal model's training cache copies V first."""
    from pathlib import Path

    from memplan.estimator.memory.qkv import fused_qkv_pin_bytes
    from memplan.model.layout import blocks
    shape = str(Path(__file__).resolve().parents[2] / "benchmarks" / "shapes" / "modernbert" / "config.json")
    for model, fields, expected in ((shape, {}, (1536 - 512) * 2),
                                    ("microsoft/Phi-3-mini-4k-instruct", {}, 0),
                                    ("microsoft/Phi-3-mini-4k-instruct", {"grad_ckpt": True}, (9216 - 3072) * 2),
                                    ("meta-llama/Llama-3.2-1B", {"grad_ckpt": True}, 0)):
        ctx = _ctx(model, precision="bf16", batch_size=2, seq_len=512, attn_impl="sdpa", **fields)
        a = ctx.spec.arch
        attn_in = [m for slot, m in blocks(ctx.spec)[0].linears if slot == "attn_in"]
        got = fused_qkv_pin_bytes(ctx, attn_in, "fused", a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim)
        assert got == expected, model


_FP32_SDPA = dict(technique="full", precision="fp32", optimizer="adamw-fused", batch_size=2, seq_len=512,
                  attn_impl="sdpa")


@pytest.mark.parametrize("model, fields, phase, measured", [
    # fp32 grouped K/V reach CUDA's math kernel (attention.gqa_in_fp32): the forward held 16 layers of fp32
    # probabilities and repeated K/V (-6.5% with the fused kernel's count); Qwen2.5-1.5B's backward peak -2.0%
    ("meta-llama/Llama-3.2-1B", _FP32_SDPA, "forward", 20604796416),
    ("Qwen/Qwen2.5-1.5B", _FP32_SDPA, "backward_start", 27167106048),
    # BART's head turns the cache off when given labels (cachefacts.labels_disable_cache): no training cache in
    # forward (+18% with it)
    ("facebook/bart-large", dict(technique="freeze", precision="fp32", optimizer="adamw-fused", trainable=1,
                                 batch_size=8, seq_len=512), "forward", 3909040640),
])
def test_phases_measured_on_an_h100(model, fields, phase, measured):
    """Per-phase peaks measured on an H100 (data/measured/gpu-h100.csv: torch 2.11, transformers 5.17, the
    validator's max_memory_allocated per phase), within 1%."""
    from memplan import libs
    with libs.assume(transformers="5.17.0"):
        est = estimate(model, Setup(**fields))
    assert abs(est.phases[phase] - measured) / measured < 0.01, est.phases


@pytest.mark.parametrize("model, fields, per_score", [
    # Llama, pure bf16: masked sum 2 + the softmax's fp32 copy of it 4 (aten softmax converts a bf16 input first) +
    # the fp32 output 4 = 10 (the cast back, 2 + 4 + 2, is smaller)
    ("meta-llama/Llama-3.2-1B", dict(technique="lora", precision="bf16"), 10),
    # Falcon QLoRA: its bf16 raw scores 2 stay named beside the fp32 masked sum 4 and fp32 probabilities 4, and the
    # previous layer's probabilities 4, which its layer returns = 14
    ("tiiuae/falcon-7b", dict(technique="qlora", precision="bf16"), 14),
    # BLOOM QLoRA: PV's bmm under autocast makes a bf16 copy 2 of the fp32 probabilities 4 while its raw scores 2
    # and masked sum 4 stay named, beside the previous layer's probabilities 4 = 16 (traced: bloomz-7b1 b4 s2048)
    ("bigscience/bloomz-7b1", dict(technique="qlora", precision="bf16"), 16),
    # the math kernel (falcon's broadcast K/V under sdpa): fp32 scores, the softmax's output and _safe_softmax's
    # bool mask 1 (aten's composite; the H100's t5-base inference held it: inference.MATH_SCORE_BYTES)
    ("tiiuae/falcon-7b", dict(technique="full", precision="bf16-mixed", attn_impl="sdpa"), 9),
])
def test_checkpointed_attention_forward_moment(model, fields, per_score):
    from memplan.estimator.memory.attention import attention_kernel
    from memplan.estimator.memory.forward_block import score_bytes
    ctx = _ctx(model, batch_size=2, seq_len=256, grad_ckpt=True, **{"attn_impl": "eager", **fields})
    assert score_bytes(ctx, attention_kernel(ctx, relative_bias=True))[0] == per_score


def test_forward_block_phase_only_where_the_forward_can_peak():
    """The in-block forward moment is a phase of checkpointed eager/math attention only: fused kernels and
    uncheckpointed blocks (their saves bound it) add none."""
    from memplan.estimator.phases import training_phases
    base = dict(technique="lora", precision="bf16", batch_size=2, seq_len=256)
    assert "forward_block" in training_phases(_ctx("tiiuae/falcon-7b", grad_ckpt=True, attn_impl="eager", **base))
    assert "forward_block" not in training_phases(_ctx("tiiuae/falcon-7b", attn_impl="eager", **base))
    assert "forward_block" not in training_phases(_ctx("meta-llama/Llama-3.2-1B", grad_ckpt=True,
                                                           attn_impl="sdpa", **base))


_SHAPES = Path(__file__).resolve().parents[2] / "benchmarks" / "shapes"


@pytest.mark.parametrize("model, fields, traced_mib, tolerance", [
    # the tracer's in-block forward peak (transformers 5.24, extrapolated per segment from 2 and 3 blocks: memplan
    # trace): Falcon's softmax with its raw scores and the previous layer's probabilities held
    ("tiiuae/falcon-7b", dict(technique="qlora", precision="bf16", batch_size=8, seq_len=1024), 17677.0, 0.005),
    # BLOOM's PV matmul: an autocast copy beside its raw scores, masked sum and both layers' probabilities (-0.6%:
    # its reshape copies q, k and v, counted as the two rotated copies a rotary family makes)
    ("bigscience/bloomz-7b1", dict(technique="qlora", precision="bf16", batch_size=4, seq_len=2048), 20465.8, 0.01),
    # Gemma's MLP: three fp32 intermediates beside the fp32 probabilities the layer keeps from its attention
    ("google/gemma-7b", dict(technique="qlora", precision="bf16", batch_size=4, seq_len=1024), 10067.7, 0.005),
    # an encoder-decoder's cross-attention: unmasked (a conversion copy of the bf16 scores) beside the self-attention's
    # probabilities (-23% with one masked moment)
    (str(_SHAPES / "mbart" / "config.json"), dict(technique="lora", lora_targets="all-linear", precision="bf16-mixed",
                                                  batch_size=4, seq_len=1024), 878.4, 0.02),
])
def test_checkpointed_forward_block_against_the_tracer(model, fields, traced_mib, tolerance):
    est = estimate(model, Setup(grad_ckpt=True, attn_impl="eager", **fields))
    got = (est.phases["forward_block"] - cublas_workspace_bytes(True)) / 2**20  # the tracer counts no workspace
    assert abs(got - traced_mib) / traced_mib < tolerance, got


@pytest.mark.parametrize("key, what, tolerance", [
    # CUDA's softmax backward makes a third score-sized gradient (memory.attention.score_grad_bytes): -11.5%,
    # -11.3% and -10.7% with two
    ("c6f8691bf34e", "Llama-2-7b QLoRA r8 bf16 eager b4 s2048 checkpointed", 0.01),
    ("65a503a56a18", "Mistral-7B QLoRA r8 bf16 eager b4 s2048 checkpointed", 0.01),
    ("8e3cffc5b17d", "falcon-7b QLoRA all-linear bf16 b1 s2048 checkpointed (math sdpa)", 0.01),
    # BLOOM's prefill softmax beside its named scores, sum, fp32 copy and the previous layer's probabilities
    # (memory.inference.prefill_working_bytes): -15.7% with (2 c + 4) bytes per score
    ("f3b8a9940136", "bloom-560m inference bf16 b4 prompt 1000", 0.01),
])
def test_eager_attention_rows_measured_on_the_h100(key, what, tolerance):
    """Peak allocated of rows the H100 measured on 2026-11-26 (data/measured/gpu-h100.csv, transformers 5.17, torch
    2.11), each estimated as it ran (memplan.measure.gate.estimate_row)."""
    from memplan.measure.gate import estimate_row
    from memplan.measure.rows import read_rows

    row = next(r for r in read_rows(Path(__file__).resolve().parents[2] / "data" / "measured" / "gpu-h100.csv")
               if r["key"] == key)
    measured = int(row["measured_allocated_bytes"])
    assert abs(estimate_row(row).peak_allocated_bytes - measured) / measured < tolerance, what


# DoRA (issue 39). Golden figures from `memplan trace` (real peft 0.21 DoRA layers on fake tensors); the matrix
# rows in benchmarks/matrices/trace_vs_estimate.yaml hold the estimate within 0.5% of the trace on 21 setups.
def test_dora_adds_magnitudes_saves_and_the_norm_rebuild():
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    base = dict(technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=256)
    lora = estimate("HuggingFaceTB/SmolLM2-135M", Setup(**base))
    dora = estimate("HuggingFaceTB/SmolLM2-135M", Setup(**base, use_dora=True))
    # trace: 2,442,240 LoRA parameters + 155,520 magnitudes (30 blocks x 5,184 output features)
    assert (lora.params_trainable, dora.params_trainable) == (2_442_240, 2_597_760)
    # two saved [tokens, out] tensors per adapted layer: bf16 base_result + fp32 lora_result = 6 B per element
    grew = dora.components["activations"] - lora.components["activations"]
    assert grew == 30 * 512 * 5_184 * 6
    big = estimate("meta-llama/Llama-3.2-1B", Setup(technique="lora", precision="bf16", lora_targets="all-linear",
                                                    batch_size=1, seq_len=64, use_dora=True))
    # the peak is the norm rebuild of the largest layer, down_proj 8192 -> 2048 (3.16 GiB of live tensors traced,
    # 3.15 estimated): the [8192, 8192] fp32 identity lora_A saves, lora_B(lora_A(I)), the bf16 weight cast to x's
    # fp32, s * BA and W + s * BA, each [2048, 8192] fp32
    assert big.peak_phase == "forward_dora"
    assert big.components["dora_temporaries"] == 8192 * 8192 * 4 + 8192 * 8 * 4 + 4 * 2048 * 8192 * 4


def test_dora_needs_an_adapter():
    from memplan.errors import SetupError
    from memplan.setup import Setup

    with pytest.raises(SetupError, match="use_dora trains a DoRA adapter"):
        Setup(technique="full", use_dora=True)


# Liger Kernel (issue 39): memplan.runtime.liger's stand-ins hold what Liger 0.8.2's kernels allocate; the matrix
# rows (benchmarks/matrices/trace_vs_estimate.yaml) keep the estimate within 3% of their trace on 16 setups.
def test_liger_drops_the_logits_and_leaner_saves():
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    base = dict(technique="lora", precision="bf16", batch_size=2, seq_len=512)
    plain = estimate("meta-llama/Llama-3.2-1B", Setup(**base))
    liger = estimate("meta-llama/Llama-3.2-1B", Setup(**base, use_liger_kernel=True))
    # traced (layers 2, extrapolated): 5.19 GiB of live tensors without Liger, 3.37 GiB with
    assert plain.peak_allocated_bytes - liger.peak_allocated_bytes > 1.5 * 2**30
    assert liger.components.get("logits", 0) < 32 * 2**20  # grad_input [1024, 2048] bf16 + one [C, V] chunk


@pytest.mark.parametrize("model, needle", [
    ("openai-community/gpt2", "Liger Kernel does not patch it"),
    ("microsoft/Phi-3-mini-4k-instruct", "memplan does not model Liger's patches for it yet")])
def test_liger_refuses_what_it_does_not_patch(model, needle):
    from memplan.errors import BadInput
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    with pytest.raises(BadInput, match=needle):
        estimate(model, Setup(technique="lora", use_liger_kernel=True))


def test_liger_is_a_training_knob():
    from memplan.errors import SetupError
    from memplan.setup import Setup

    with pytest.raises(SetupError, match="use_liger_kernel patches the training step"):
        Setup(mode="infer", use_liger_kernel=True)


def test_bnb_8bit_keeps_embeddings_in_32_bit_as_trainer_does():
    """transformers Trainer.create_optimizer registers every nn.Embedding weight for 32-bit bitsandbytes state
    (GlobalOptimManager.register_module_override(module, "weight", {"optim_bits": 32})): 8 B per element for AdamW
    instead of ~2.03. Rows measured by memplan 0.1 (whose runner did not) are estimated as it ran."""
    from memplan import libs
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    s = Setup(technique="full", precision="bf16", optimizer="adamw-8bit", batch_size=1, seq_len=128)
    now = estimate("meta-llama/Llama-3.1-8B", s).components["optimizer_state"]
    with libs.assume(memplan="0.1.0"):
        before = estimate("meta-llama/Llama-3.1-8B", s).components["optimizer_state"]
    vocab, hidden = 128_256, 4096  # embed_tokens; the untied lm_head is an nn.Linear: 8-bit
    blocks = -(-vocab * hidden // 256)
    assert now - before == 8 * vocab * hidden - 2 * (vocab * hidden + 4 * blocks)


@pytest.mark.parametrize("optimizer, per_element", [
    ("lion-32bit", 4.0), ("paged-adamw-32bit", 8.0),  # bitsandbytes 32-bit: fp32 states whatever the param dtype
    ("lion-8bit", 1 + 4 / 256), ("adamw-8bit", 2 + 8 / 256),  # uint8 states + an fp32 absmax per 256
    ("adamw-torch-8bit", 2 + 8 / 256), ("adamw-torch-4bit", 1 + 8 / 256),  # torchao, block 256 (+ code tables)
    ("schedule-free-adamw", 4.0)])  # z and exp_avg_sq in the bf16 param dtype
def test_optimizer_state_per_element(optimizer, per_element):
    """State bytes per element of a large 2-D weight (LoRA all-linear excluded: full fine-tuning of Llama-3.2-1B's
    blocks in bf16): the formulas of memplan/estimator/memory/optimizer.py, each from its library's code."""
    from memplan.estimator.memory.optimizer import STATE_FN

    shape = (8192, 2048)
    got = STATE_FN[optimizer](shape, 2) / (shape[0] * shape[1])
    assert got == pytest.approx(per_element, rel=1e-3)


def test_added_tokens_count_in_the_total():
    """issue 42 item 8: --added-tokens 3 on gpt2 showed more trainable (124,442,112) than total (124,439,808)
    parameters; the total is the resized model's (the tied wte grows by 3 x 768)."""
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    e = estimate("gpt2", Setup(technique="full", added_tokens=3))
    assert e.params_total == e.params_trainable == 124_439_808 + 3 * 768


def test_training_added_tokens_modules_to_save_vs_token_indices():
    """issue 39: Llama-3.1-8B (vocabulary 128,256, hidden 4,096, untied head) with 8 added tokens under LoRA bf16.
    modules_to_save: two more bf16 tables resident and trained (grads + AdamW state in bf16); token indices: the new
    rows only, [8, 4096] fp32 per table. Matrix rows (trace_vs_estimate.yaml) keep both within 2% of the trace."""
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup

    base = dict(technique="lora", precision="bf16", added_tokens=8, batch_size=1, seq_len=512)
    plain = estimate("meta-llama/Llama-3.1-8B", Setup(**base))
    copies = estimate("meta-llama/Llama-3.1-8B", Setup(**base, train_new_tokens="modules-to-save"))
    rows = estimate("meta-llama/Llama-3.1-8B", Setup(**base, train_new_tokens="token-indices"))
    table = (128_256 + 8) * 4096
    assert copies.params_trainable - plain.params_trainable == 2 * table
    assert rows.params_trainable - plain.params_trainable == 2 * 8 * 4096
    assert copies.components["weights"] - plain.components["weights"] == 2 * table * 2
    assert copies.components["optimizer_state"] - plain.components["optimizer_state"] == 2 * table * 2 * 2
    assert copies.peak_allocated_bytes - rows.peak_allocated_bytes > 4 * 2**30  # gigabytes on a 128k vocabulary


def test_train_new_tokens_needs_added_tokens_and_lora():
    from memplan.errors import SetupError
    from memplan.setup import Setup

    with pytest.raises(SetupError, match="train_new_tokens chooses how LoRA trains added tokens"):
        Setup(technique="lora", train_new_tokens="token-indices")
    with pytest.raises(SetupError, match="train_new_tokens"):
        Setup(technique="full", added_tokens=2, train_new_tokens="modules-to-save")


def test_moe_serving_working_set_by_hand():
    """transformers 5 grouped_mm_experts_forward, per route in the weight dtype (bf16): gpt-oss-20b (H = I = 2880,
    biased experts, its 5-tensor gate) peaks at the gate, 1 + 2 + 2 + 5 = 10 units of 2880; Qwen3-30B-A3B (H 2048,
    expert width 768 from down_proj, not intermediate_size 6144) after the down projection, 4 x 2048."""
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.moe import inference_expert_bytes
    from memplan.model.catalog import load_spec
    s = Setup(mode="infer", precision="bf16", batch_size=1, new_tokens=1)
    oss = resolve(load_spec("openai/gpt-oss-20b"), s)
    assert inference_expert_bytes(oss, 100) == 100 * 4 * 10 * 2880 * 2
    qwen = resolve(load_spec("Qwen/Qwen3-30B-A3B"), s)
    assert inference_expert_bytes(qwen, 100) == 100 * 8 * 4 * 2048 * 2


def test_galore_state_by_hand():
    """galore_torch GaLoreAdamW (optim="galore_adamw", targets attn and mlp, rank 128): a projected [m, n] weight keeps
    the orthogonal matrix ([128, n] when m >= n, else [m, 128]) and two moments of the projected gradient ([m, 128],
    else [128, n]) in bf16; with fp32 weights the matrix is a slice of the SVD's Vh (U), which stays referenced whole
    ([k, n], [m, k], k = min(m, n)). Untargeted tensors (SmolLM2-135M's tied embedding, the norms) keep two Adam
    moments."""
    from memplan.errors import SetupError
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.optimizer import galore_state_bytes, low_rank_targets
    from memplan.model.catalog import load_spec
    spec = load_spec("HuggingFaceTB/SmolLM2-135M")
    for precision, b in (("bf16", 2), ("fp32", 4)):
        ctx = resolve(spec, Setup(technique="full", precision=precision, optimizer="galore-adamw"))
        targets = low_rank_targets(ctx)
        assert "model.layers.0.self_attn.q_proj.weight" in targets and "model.embed_tokens.weight" not in targets
        expected = 0
        for p in spec.params:
            if p.name not in targets:
                expected += 2 * p.numel * b
                continue
            m, n = p.shape
            r, k = min(128, m, n), min(m, n)
            kept = k if b == 4 else r
            expected += (kept * n + 2 * m * r) * b if m >= n else (m * kept + 2 * r * n) * b
        assert galore_state_bytes(ctx) == expected
        assert len(targets) == 7 * 30  # q, k, v, o, gate, up, down in each of 30 blocks
    with pytest.raises(SetupError, match="technique full"):
        Setup(technique="lora", optimizer="galore-adamw")


def test_apollo_state_and_step_by_hand():
    """apollo_torch APOLLOAdamW (optim="apollo_adamw", targets attn and mlp, rank 128, random projection): a projected
    [m, n] weight keeps the [128, min(m, n)] random matrix and two moments of the [128, max(m, n)] projected gradient,
    in the weights' dtype; untargeted tensors two Adam moments. Its later steps hold the projected gradient, denom,
    exp_avg / denom and two [m, n] scaled gradients (the norm-growth limiter's division) at once. The traced
    optimizer step agrees to the byte but the cuBLAS workspace (benchmarks/matrices/trace_vs_estimate.yaml)."""
    from memplan.errors import BadInput, SetupError
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.optimizer import apollo_state_bytes, apollo_temp_bytes, low_rank_targets
    from memplan.model.catalog import load_spec
    spec = load_spec("HuggingFaceTB/SmolLM2-135M")  # hidden 576, MLP 1536, K/V 192
    for precision, b in (("bf16", 2), ("fp32", 4)):
        ctx = resolve(spec, Setup(technique="full", precision=precision, optimizer="apollo-adamw"))
        targets = low_rank_targets(ctx)
        expected = sum(128 * (min(p.shape) + 2 * max(p.shape)) * b if p.name in targets else 2 * p.numel * b
                       for p in spec.params)
        assert apollo_state_bytes(ctx) == expected
        # the tied [49152, 576] embedding's two Adam buffers outweigh any projected weight's step (gate/up/down
        # [1536, 576]: 3 x 128 x 1536 + 2 x 1536 x 576 elements), as in every catalog model trained in full
        assert apollo_temp_bytes(ctx) == max(2 * 49152 * 576 * b, (3 * 128 * 1536 + 2 * 1536 * 576) * b)
    with pytest.raises(SetupError, match="apollo-adamw projects the gradients of full-rank weights"):
        Setup(technique="lora", optimizer="apollo-adamw")
    with pytest.raises(BadInput, match="No target modules found"):  # GPT-2's Conv1D: transformers stops too
        estimate("gpt2", Setup(technique="full", optimizer="apollo-adamw"))
