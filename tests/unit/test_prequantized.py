"""Pre-quantized checkpoints served (issue 40): the stored formats' bytes, the uploads' ids, the card's kernels.

The traced agreement is pinned by the quant=gptq-int4/gptq-int8/awq/fp8 inference rows of
benchmarks/matrices/trace_vs_estimate.yaml; here the closed forms by hand and the user-facing rules.
"""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import SetupError
from memplan.estimator.breakdown import estimate, estimator_for
from memplan.estimator.memory.weights import alloc_bytes, prequantized_state_bytes
from memplan.gpus import find_gpu
from memplan.model.catalog import load_spec
from memplan.setup import Setup


def test_state_bytes_of_one_linear_by_hand():
    """A 4096 x 11008 Linear (Llama-2-7B's gate_proj, in x out), group size 128 (32 groups of the 4096 inputs)."""
    k, n = 4096, 11008
    workspace = alloc_bytes(132 * 4)  # Marlin's per-layer int32 workspace
    assert prequantized_state_bytes("gptq-int4", k, n) == alloc_bytes(32 * n * 2) + workspace  # fp16 scales only
    # AWQ keeps its packed zeros: int32 [groups, n x 4 / 32]
    assert prequantized_state_bytes("awq", k, n) == alloc_bytes(32 * n * 2) + alloc_bytes(32 * 1376 * 4) + workspace
    # FP8: one fp32 scale per 128 x 128 block of the [n, k] weight
    assert prequantized_state_bytes("fp8", k, n) == alloc_bytes(math.ceil(n / 128) * 32 * 4)


@pytest.mark.parametrize("upload, quant, per_weight", [
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "gptq-int4", 0.5), ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "gptq-int8", 1.0),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "awq", 0.5), ("Qwen/Qwen3-8B-FP8", "fp8", 1.0)])
def test_uploads_resolve_to_their_base_and_format(upload, quant, per_weight):
    spec = load_spec(upload)
    assert spec.checkpoint_quant == quant and spec.variant_of
    stored = estimate(spec, Setup(mode="infer", precision="bf16", quant=quant, batch_size=1, new_tokens=1))
    full = estimate(spec.variant_of, Setup(mode="infer", precision="bf16", batch_size=1, new_tokens=1))
    quantized = sum(m.in_features * m.out_features for m in spec.linears if m.block is not None)
    # the blocks' Linear weights shrink from 2 bytes to the format's; everything else is the same
    assert stored.components["weights"] == pytest.approx(full.components["weights"] - quantized * (2 - per_weight),
                                                         rel=1e-3)


def test_compressed_tensors_fp8_is_named_not_guessed():
    r = CliRunner().invoke(main, ["estimate", "RedHatAI/Llama-3.1-8B-Instruct-FP8-Dynamic"])
    assert r.exit_code == 2 and "compressed-tensors FP8" in r.output


def test_fp8_loads_dequantized_below_compute_capability_8_9():
    s = Setup(mode="infer", precision="bf16", quant="fp8", batch_size=1, new_tokens=1)
    h100 = estimator_for(find_gpu("h100"))("Qwen/Qwen3-8B-FP8", s)
    rtx3060 = estimator_for(find_gpu("rtx 3060"))("Qwen/Qwen3-8B-FP8", s)
    bf16 = estimate("Qwen/Qwen3-8B", Setup(mode="infer", precision="bf16", batch_size=1, new_tokens=1))
    assert rtx3060.components["weights"] == bf16.components["weights"] > h100.components["weights"]
    assert any("dequantized" in n for n in rtx3060.notes)


def test_lora_on_a_stored_quantized_base_is_refused_until_modelled():
    with pytest.raises(SetupError, match="not modelled yet"):
        Setup(technique="lora", quant="gptq-int4")
    r = CliRunner().invoke(main, ["estimate", "Qwen/Qwen2.5-7B-Instruct-AWQ", "--technique", "lora"])
    assert r.exit_code == 2 and "--mode infer" in r.output


def test_fit_serves_an_upload_as_stored():
    r = CliRunner().invoke(main, ["fit", "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "--gpu", "rtx 3060", "--json"])
    assert r.exit_code == 0, r.output
    import json
    d = json.loads(r.stdout)  # the upload's note goes to stderr
    assert [o["option"] for o in d["options"]] == ["inference gptq-int4 (as stored)"]
    assert d["options"][0]["fits"] and d["multi_gpu"] == []
