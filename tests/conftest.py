"""Shared fixtures: a hand-built tiny Llama-shaped ModelSpec (pure, no torch) whose numbers are easy to derive.

Test tiers (CONTRIBUTING.md): tests/unit is the fast tier, `python -m pytest -m "not slow"` (under a minute on two
cores); every test under tests/integration (the tracer, DeepSpeed, subprocesses, real Trainer steps) is marked slow
here, as are the few slow tests in tests/unit; `python -m pytest` runs both, as CI does. Tests marked gpu are skipped
without CUDA.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"
# local configs' inventories are cached on disk (memplan.fileio.cache_dir): the tests keep theirs apart
os.environ.setdefault("MEMPLAN_CACHE", tempfile.mkdtemp(prefix="memplan-test-cache-"))


def pytest_collection_modifyitems(config, items):
    cuda = None
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu"):
            if cuda is None:
                import torch
                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))

from memplan.model.spec import Arch, Linear, ModelSpec, Param

H, HEADS, KV, HD, I, V, LAYERS = 64, 4, 2, 16, 128, 1000, 2


def tiny_llama(tied: bool = False, layers: int = LAYERS) -> ModelSpec:
    """Llama-like: RMSNorm, q/k/v/o (GQA 4 heads / 2 kv heads of 16), SwiGLU MLP 64->128, vocab 1000."""
    params: list[Param] = [Param("model.embed_tokens.weight", (V, H), "embedding")]
    linears: list[Linear] = []
    shapes = {"self_attn.q_proj": (HEADS * HD, H), "self_attn.k_proj": (KV * HD, H), "self_attn.v_proj": (KV * HD, H),
              "self_attn.o_proj": (H, HEADS * HD), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
              "mlp.down_proj": (H, I)}
    for i in range(layers):
        for mod, (out, inp) in shapes.items():
            name = f"model.layers.{i}.{mod}"
            params.append(Param(name + ".weight", (out, inp), "linear", i, "decoder"))
            linears.append(Linear(name, inp, out, False, i, "decoder"))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params.append(Param(f"model.layers.{i}.{norm}.weight", (H,), "norm", i, "decoder"))
    params.append(Param("model.norm.weight", (H,), "norm"))
    tied_pairs: tuple = ()
    if tied:
        tied_pairs = (("lm_head.weight", "model.embed_tokens.weight"),)
    else:
        params.append(Param("lm_head.weight", (V, H), "lm_head"))
    linears.append(Linear("lm_head", H, V, False, None, None, "linear", True))
    arch = Arch(kind="causal", model_type="llama", auto_class="AutoModelForCausalLM", hidden_size=H, num_heads=HEADS,
                num_kv_heads=KV, head_dim=HD, intermediate_size=I, vocab_size=V, num_decoder_layers=layers,
                mlp_gated=True, hidden_act="silu", norm="rmsnorm", max_positions=4096, tie_word_embeddings=tied,
                lora_default_targets=("q_proj", "v_proj"))
    return ModelSpec("test/tiny-llama", arch, tuple(params), tuple(linears), tied_pairs)


@pytest.fixture
def tiny() -> ModelSpec:
    return tiny_llama()
