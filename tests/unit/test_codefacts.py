"""Facts memplan reads from a family's own code when it builds the inventory (memplan.inventory.probes): what its norm layer
and its activation save for backward, measured on meta / fake tensors. Golden values are the saves torch's
tools/autograd/derivatives.yaml gives for each module's ops (cited per case)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.model.catalog import load_spec

SHAPES = Path(__file__).resolve().parents[2] / "benchmarks" / "shapes"


@pytest.mark.parametrize("model, expected", [
    # LlamaRMSNorm: fp32 copy (pow and mul save it) + rsqrt's fp32 output per row; a trained weight saves the
    # normalised tensor cast back to the input dtype (modeling_llama.py LlamaRMSNorm.forward). The third value: an
    # fp32 input's `.to(torch.float32)` is the input itself (Tensor.to returns self when nothing changes)
    ("meta-llama/Llama-2-7b-hf", ((4, 4, 0), (6, 4, 0), (4, 4, 4), (8, 4, 4))),
    # T5LayerNorm multiplies the 16-bit input itself by rsqrt (modeling_t5.py): the input is saved as well
    ("google-t5/t5-base", ((6, 4, 2), (8, 4, 2), (4, 4, 4), (8, 4, 4))),
    # GemmaRMSNorm applies (1 + weight) in fp32: the normalised tensor is fp32 whatever the model dtype
    ("google/gemma-7b", ((4, 4, 0), (8, 4, 0), (4, 4, 4), (8, 4, 4))),
    # nn.LayerNorm (aten native_layer_norm): its input plus fp32 mean and rstd per row; the weight saves nothing more
    ("openai-community/gpt2", ((2, 8, 2), (2, 8, 2), (4, 8, 4), (4, 8, 4))),
    # CohereLayerNorm centres twice in fp32 (modeling_cohere.py): two fp32 centred copies, + the normalised tensor
    (str(SHAPES / "cohere2" / "config.json"), ((8, 4, 0), (12, 4, 0), (8, 4, 0), (12, 4, 0))),
    # OlmoLayerNorm: F.layer_norm on an fp32 copy, no parameters
    (str(SHAPES / "olmo" / "config.json"), ((4, 8, 0), (4, 8, 0), (4, 8, 4), (4, 8, 4))),
])
def test_norm_saves_per_family(model, expected):
    assert load_spec(model).arch.norm_saves == expected


@pytest.mark.parametrize("model, norm, act_dropout", [
    # T5DenseGatedActDense (modeling_t5.py): wi_0, act, wi_1, `self.dropout`, wo - dropout_rate 0.1 between the
    # projections; T5LayerNorm scales by rsqrt without centring
    ("google-t5/t5-base", "rmsnorm", 0.1),
    (str(SHAPES / "umt5" / "config.json"), "rmsnorm", 0.1),  # UMT5's copies of both (the family lists missed them)
    ("openai-community/gpt2", "layernorm", 0.0),  # GPT2MLP's Dropout runs after c_proj: the residual dropout
    ("facebook/bart-large", "layernorm", 0.1),  # BART applies config.activation_dropout functionally
    ("meta-llama/Llama-2-7b-hf", "rmsnorm", 0.0),
    (str(SHAPES / "olmo" / "config.json"), "layernorm", 0.0),  # OlmoLayerNorm: no parameters, centres
])
def test_norm_kind_and_mlp_dropout_read_from_the_model(model, norm, act_dropout):
    arch = load_spec(model).arch
    assert (arch.norm, arch.act_dropout) == (norm, act_dropout)


@pytest.mark.parametrize("shape, copy", [
    ("deepseek_v3", 4.0),  # DeepseekV3TopkRouter: F.linear(hidden_states.type(torch.float32), ...)
    ("dots1", 4.0),
    ("qwen3_moe", 0.0),  # Qwen3MoeTopKRouter: F.linear(hidden_states, self.weight) saves the input itself
    ("olmoe", 0.0),
    ("qwen3", 0.0),  # no router
])
def test_router_copy_is_measured_on_the_family_router(shape, copy):
    assert load_spec(str(SHAPES / shape / "config.json")).arch.router_copy == copy


@pytest.mark.parametrize("model, parallel", [
    (str(SHAPES / "cohere2" / "config.json"), True),  # one input_layernorm for attention and MLP (a list missed it)
    (str(SHAPES / "cohere" / "config.json"), True),
    (str(SHAPES / "gptj" / "config.json"), True),
    ("microsoft/phi-2", True),
    ("tiiuae/falcon-7b", True),  # config: parallel_attn
    ("EleutherAI/pythia-1b", True),  # config: use_parallel_residual over two norms
    ("google-t5/t5-base", False),  # two norms per block, in sublayers named layer.0 / layer.1
    (str(SHAPES / "modernbert" / "config.json"), False),  # its first block's attn_norm is an Identity
    ("meta-llama/Llama-2-7b-hf", False),
])
def test_parallel_blocks_are_read_from_the_model(model, parallel):
    assert load_spec(model).arch.parallel_block is parallel


@pytest.mark.parametrize("model, flag, copied", [
    (str(SHAPES / "gpt_neox" / "config.json"), True, True),  # torch.cat((query_rot, query_pass)): heads-first q
    (str(SHAPES / "stablelm" / "config.json"), True, True),  # the same cat, in the attention's forward
    ("microsoft/Phi-3-mini-4k-instruct", True, True),  # its apply_rotary_pos_emb concatenates (an empty pass part)
    ("meta-llama/Llama-2-7b-hf", False, False),  # elementwise rotation keeps the sequence-first layout
    (str(SHAPES / "qwen3" / "config.json"), False, False),
    # MLA's q is a cat too, but its values' other head size runs CUDA's efficient kernel, which writes [b, s, h, d]
    (str(SHAPES / "deepseek_v3" / "config.json"), True, False),
])
def test_heads_first_attention_output_is_read_from_the_model(model, flag, copied):
    from memplan.estimator.memory.block_tail import fused_output_copied
    from memplan.estimator.memory.context import resolve
    from memplan.setup import Setup

    spec = load_spec(model)
    assert spec.arch.attn_out_copy is flag
    ctx = resolve(spec, Setup(technique="full", precision="bf16", attn_impl="sdpa"))
    assert fused_output_copied(ctx) is copied
    assert not fused_output_copied(resolve(spec, Setup(technique="full", precision="fp32", attn_impl="sdpa")))


def test_olmo_counts_its_parameter_free_final_norm():
    assert load_spec(str(SHAPES / "olmo" / "config.json")).arch.weightless_final_norms == 1
    assert load_spec(str(SHAPES / "olmo2" / "config.json")).arch.weightless_final_norms == 0  # its norm has a weight


def test_seed_oss_residual_dropout_is_the_hidden_dropout(tmp_path):
    # modeling_seed_oss.py drops the attention and MLP outputs with config.residual_dropout
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "seed_oss", "architectures": ["SeedOssForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "residual_dropout": 0.1}))
    assert load_spec(str(tmp_path / "config.json")).arch.hidden_dropout == 0.1


@pytest.mark.parametrize("model, post_norm, dropouts", [
    (str(SHAPES / "distilbert" / "config.json"), True, 1),  # sa_layer_norm after attention; dropout after its FFN alone
    (str(SHAPES / "xlm-roberta" / "config.json"), True, 2),  # the lists named roberta, not xlm-roberta
    ("facebook/bart-base", True, 2),
    (str(SHAPES / "mbart" / "config.json"), False, 2),  # pre-LN, encoder and decoder end with a layer_norm
    (str(SHAPES / "olmo2" / "config.json"), False, 0),  # attention before its first norm, but a final norm: pre-LN
    ("meta-llama/Llama-2-7b-hf", False, 0),  # no dropout
])
def test_post_norm_and_residual_dropouts_are_read_from_the_model(model, post_norm, dropouts):
    arch = load_spec(model).arch
    assert (arch.post_norm, arch.residual_dropouts) == (post_norm, dropouts)


@pytest.mark.slow
def test_umt5_saves_its_mlp_dropout_mask():
    # the tracer (fake tensors, transformers' own UMT5 step) against the estimate, full bf16 b2 s512: 12 [b, s, d_ff]
    # masks (1.5 MiB each) were missing with act_dropout 0 (-1.93%, benchmarks/results/trace_vs_estimate.md)
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup
    from memplan.tracer.training import comparable_estimate_bytes, trace

    setup = Setup(technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=512)
    model = str(SHAPES / "umt5" / "config.json")
    traced = trace(model, setup).peak_tensor_bytes
    assert comparable_estimate_bytes(estimate(model, setup)) == pytest.approx(traced, rel=0.01)


@pytest.mark.parametrize("act, expected", [
    ("silu", (2, 4, 2, 4) * 2),  # one ATen op: its input
    # gelu_new (activations.py NewGELUActivation): pow saves x, tanh its output, the product 0.5x and 1 + tanh; under
    # CUDA autocast pow runs in fp32, so x and the tanh chain are fp32 (4 + 4 + 2 + 4)
    ("gelu_new", (8, 16, 14, 16) * 2),
    ("quick_gelu", (4, 8, 4, 8) * 2),  # x * sigmoid(1.702 x): x and the sigmoid's output
    # xIELU (activations.py XIELUActivation, Python path): its trainable alphas need more of its intermediates
    ("xielu", (7, 13, 11, 13, 9, 17, 15, 17)),
])
def test_activation_saves(act, expected):
    from memplan.inventory.probes import act_saves

    assert act_saves(act) == expected


def test_olmo_counts_its_parameter_free_norms(tmp_path):
    from memplan.model.layout import blocks

    spec = load_spec(str(SHAPES / "olmo" / "config.json"))
    assert spec.arch.weightless_norms == 2
    assert {b.norms for b in blocks(spec)} == {2}


def test_qlora_activations_are_fp32_under_autocast():
    # bitsandbytes layers return fp32 after k-bit preparation, so gelu_new's input is fp32 under autocast (16 bytes),
    # not the 16-bit case (14)
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.saves import act_saved_bytes
    from memplan.setup import Setup

    ctx = resolve(load_spec("openai-community/gpt2"), Setup(technique="qlora", precision="bf16"))
    assert ctx.mixed and act_saved_bytes(ctx) == 16


def test_stored_inventory_round_trips_the_measured_facts(tmp_path):
    from memplan.model.spec import ModelSpec

    spec = load_spec(str(SHAPES / "cohere2" / "config.json"))
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.arch == spec.arch


@pytest.mark.parametrize("model, plain", [
    ("google-bert/bert-base-uncased", True), ("google-t5/t5-base", True), ("facebook/bart-base", True),
    ("meta-llama/Llama-2-7b-hf", False), ("openai-community/gpt2", False),
    # families a list of four missed: BERT-like encoders and BART-like seq2seq models copy `CrossEntropyLoss()`
    (str(SHAPES / "roberta" / "config.json"), True), (str(SHAPES / "mbart" / "config.json"), True),
])
def test_plain_cross_entropy_is_read_from_the_head(model, plain):
    assert load_spec(model).arch.plain_cross_entropy is plain


def test_a_tied_head_registered_first_is_still_the_alias(tmp_path):
    # XLMRobertaForMaskedLM registers lm_head before roberta: the embedding keeps the weight, the head is its alias
    cfg = json.loads((SHAPES / "xlm-roberta" / "config.json").read_text())
    del cfg["architectures"]  # a family with a masked-LM class and no architectures is built as the encoder
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_spec(str(tmp_path / "config.json"))
    assert spec.arch.auto_class == "AutoModelForMaskedLM" and spec.arch.tie_word_embeddings
    assert ("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight") in spec.tied


def test_expert_gating_is_measured_on_the_family_function():
    # GptOssExperts._apply_gate keeps gate_up [2I] (the clamps save their input) and four [I] tensors: clamped gate,
    # sigmoid output, up + 1 and glu - 6 elements per gated element, where SwiGLU's act(gate) * up keeps 3 (Mixtral)
    assert load_spec(str(SHAPES / "gpt_oss" / "config.json")).arch.expert_gate_saves == (12, 24)
    assert load_spec("mistralai/Mixtral-8x7B-v0.1").arch.expert_gate_saves == (6, 12)


@pytest.mark.slow
def test_a_token_mixer_other_than_attention_is_named_in_the_notes(tmp_path, monkeypatch):
    # Qwen3-Next's linear_attention layers (gated DeltaNet) are measured (linfacts); a mixer that does not run on
    # fake tensors stays unmodelled and is named in the notes (a shaped config traced 55% above before)
    from memplan.inventory import linear_attention as linfacts
    from memplan.estimator.breakdown import estimate

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256}))
    spec = load_spec(str(tmp_path / "config.json"))
    assert spec.arch.unmodelled_layers == () and spec.arch.linear_saves
    notes = estimate(spec, technique="lora", lora_targets="all-linear", precision="bf16").notes
    assert not any("linear_attention" in n for n in notes)

    def refuse(*args, **kwargs):
        raise NotImplementedError("no fake kernel")
    monkeypatch.setattr(linfacts, "_run", refuse)
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "fresh-cache"))  # build anew: the same content is cached
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text((tmp_path / "config.json").read_text())
    spec = load_spec(str(tmp_path / "other" / "config.json"))
    assert spec.arch.unmodelled_layers == ("linear_attention",) and spec.arch.linear_saves == ()
    notes = estimate(spec, technique="lora", lora_targets="all-linear", precision="bf16").notes
    assert any("linear_attention" in n and "lower bound" in n for n in notes)
    assert load_spec("meta-llama/Llama-2-7b-hf").arch.unmodelled_layers == ()


def test_case_indices_follow_the_measured_tables_order():
    from memplan.model.spec import ACT_CASES, NORM_CASES, act_case, norm_case

    for trains in (False, True):
        for mixed in (False, True):
            for c, dtype in ((2, "bfloat16"), (4, "float32")):
                assert act_case(trains, mixed, c) == ACT_CASES.index((trains, dtype, mixed))
        for r in (2, 4):
            assert norm_case(r, trains) == NORM_CASES.index((r, trains))




def test_llama4_experts_see_every_token():
    # Llama4TextMoe repeats the tokens once per expert, scaled by the router's scores (zero where not chosen): every
    # expert computes and saves every token. Measured on meta tensors (codefacts.experts_dense); the grouped_mm
    # families hand their experts each token's top-k
    assert load_spec(str(SHAPES / "llama4_text" / "config.json")).arch.experts_dense
    assert not load_spec("mistralai/Mixtral-8x7B-v0.1").arch.experts_dense
    assert not load_spec(str(SHAPES / "qwen3_moe" / "config.json")).arch.experts_dense


def test_albert_runs_its_shared_layer_for_every_block():
    # AlbertTransformer runs albert_layer_groups[0] num_hidden_layers times: one block of parameters, six runs
    from memplan.errors import BadInput
    from memplan.estimator.breakdown import estimate

    spec = load_spec(str(SHAPES / "albert" / "config.json"))
    assert spec.arch.block_runs == 6 and {p.block for p in spec.params if p.block is not None} == {0}
    assert load_spec("google-bert/bert-base-uncased").arch.block_runs == 1
    once = estimate(spec, technique="full", precision="bf16", batch_size=2, seq_len=256)
    assert once.components["activations"] > 0
    # transformers refuses gradient checkpointing on ALBERT (supports_gradient_checkpointing = False)
    with pytest.raises(BadInput, match="gradient checkpointing"):
        estimate(spec, technique="full", precision="bf16", grad_ckpt=True)


@pytest.mark.parametrize("model, expected", [
    # modeling_bart.py BartForConditionalGeneration.forward: `if labels is not None: ... use_cache = False`
    ("facebook/bart-large", True),
    (str(SHAPES / "mbart" / "config.json"), True),
    # T5 and causal LMs keep the config's use_cache in training (their DynamicCache is built: the tracer holds it)
    ("google-t5/t5-base", False),
    ("meta-llama/Llama-3.2-1B", False),
])
def test_heads_that_turn_the_cache_off_given_labels(model, expected):
    assert load_spec(model).arch.labels_disable_cache is expected


@pytest.mark.parametrize("act, expected", [
    # gelu_new under CUDA autocast: pow runs in fp32 and promotes the product, so a 16-bit input returns fp32
    ("gelu_new", (2, 4, 4, 4) * 2),
    ("silu", (2, 4, 2, 4) * 2),  # one ATen op: the input's dtype
])
def test_activation_output_bytes(act, expected):
    from memplan.inventory.activation import act_out_bytes
    assert act_out_bytes(act) == expected


@pytest.mark.parametrize("model, held, returns", [
    ("tiiuae/falcon-7b", (True, False, False), True),  # softmax(attention_scores + attention_mask, dtype=hidden)
    ("bigscience/bloom-560m", (True, True, True), True),  # scores viewed, summed under a new name, probs a third
    ("meta-llama/Llama-3.2-1B", (False, False, True), False),  # one name reassigned; .to(query.dtype)
    ("openai-community/gpt2", (False, False, True), False),  # .type(value.dtype) on the next line
    ("google-bert/bert-large-uncased", (False, False, False), False),
])
def test_eager_attention_flow_is_read_from_the_family_code(model, held, returns):
    """attnfacts reads which score-sized tensors the eager attention keeps named through its softmax and whether the
    decoder layer returns its probabilities (transformers 5: Falcon's and BLOOM's layers do), as installed."""
    arch = load_spec(model).arch
    assert tuple(arch.eager_held) == held
    assert arch.returns_attn_probs is returns


def test_eager_flow_parser_on_written_sources():
    from memplan.inventory.attention import eager_held
    llama = ("    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling\n"
             "    attn_weights = attn_weights + causal_mask\n"
             "    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)\n")
    falcon = ("        attention_scores = query_layer @ key_layer.transpose(-1, -2)\n"
              "        attention_scores = F.softmax(attention_scores + attention_mask, dim=-1, dtype=hidden_states.dtype)\n"
              "        attn_output = attention_scores @ value_layer\n")
    assert eager_held(llama) == (False, False, True)
    assert eager_held(falcon) == (True, False, False)
    assert eager_held(None) == (False, False, True)  # no source: Llama's flow, the common case


def test_linear_attention_layers_are_measured():
    """Qwen3-Next's gated DeltaNet layers (config layer_types "linear_attention") run on fake tensors when the
    inventory is built: per token, what they save (over 300 KB for this 512-wide shape: fp32 copies of q, k, v and
    their chunked products) and their backward's working memory; no longer named as not modelled. Families without such layers measure nothing."""
    from memplan.model.spec import LINEAR_CASES
    arch = load_spec(str(SHAPES / "qwen3_next" / "config.json")).arch
    assert arch.linear_layers == (0, 1, 2) and arch.unmodelled_layers == ()
    assert len(arch.linear_saves) == len(arch.linear_work) == len(LINEAR_CASES)
    bf16, fp32 = arch.linear_saves[0], arch.linear_saves[2]
    assert 300_000 < bf16 < fp32  # the recurrence computes in fp32 either way; its inputs and outputs follow the dtype
    llama = load_spec("meta-llama/Llama-3.2-1B").arch
    assert llama.linear_layers == () and llama.linear_saves == ()
