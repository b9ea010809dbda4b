"""Catalog and inventory tests: published parameter totals, offline behaviour, bad configs, remote code."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memplan.errors import BadInput, NotFound, OfflineError
from memplan.model.catalog import catalog_index, load_spec
from memplan.model import catalog

# Totals: memplan/data/models/SOURCES.md "published reference" / "computed params" columns (exact = the model card
# or paper states the exact count; the others were checked there against the card within its tolerance).
PUBLISHED = {
    "openai-community/gpt2": 124_439_808,  # exact (HF)
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,  # exact
    "EleutherAI/pythia-1b": 1_011_781_632,  # exact, Pythia paper
    "bigscience/bloom-560m": 559_214_592,  # exact, model card
    "bigscience/bloomz-7b1": 7_069_016_064,  # exact, BLOOM-7b1 card
    "google-bert/bert-base-uncased": 109_514_298,  # card "110M"
    "google/flan-t5-xl": 2_849_757_184,  # untied lm_head (file says tie_word_embeddings: false)
    "bigscience/T0_3B": 2_849_757_184,  # untied lm_head
    "bigscience/mt0-xxl": 12_921_057_280,  # untied lm_head, card "13B"
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,  # "46.7B total"
    "meta-llama/Llama-3.1-8B": 8_030_261_248,  # 8.03B
    "Qwen/Qwen2.5-7B": 7_615_616_512,  # 7.61B
    "meta-llama/Llama-3.2-1B": 1_235_814_400,  # 1.23B (tied embeddings)
    "facebook/bart-large": 406_291_456,  # card "400M"
}


@pytest.mark.parametrize("model_id,total", sorted(PUBLISHED.items()))
def test_published_totals(model_id, total):
    assert load_spec(model_id).numel_total == total


def test_catalog_covers_shared_configs_with_sources():
    index = catalog_index()
    assert len(index) >= 250  # issue 37
    assert all(row["source"] for row in index.values()), "every catalog row needs a source (SOURCES.md)"
    configs = {k for k, row in index.items() if not row.get("variant_of")}
    assert all(index[k]["source"].startswith(("verbatim; ", "reconstructed; ")) for k in configs)
    assert all(row["variant_of"] in configs for row in index.values() if row.get("variant_of"))


# issue 37: the ids a new user tried, refused offline before; each with the base config that answers it
@pytest.mark.parametrize("model_id, answers_from", [
    ("Qwen/Qwen3-8B", ""), ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"), ("google/gemma-3-12b-it", "google/gemma-3-12b-pt"),
    ("openai/gpt-oss-20b", ""), ("microsoft/phi-4", ""), ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", ""),
    ("mistralai/Mistral-Small-24B-Instruct-2501", "mistralai/Mistral-Small-24B-Base-2501"),
    ("unsloth/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B")])
def test_current_models_answer_offline(model_id, answers_from):
    spec = load_spec(model_id)
    assert spec.variant_of == answers_from
    assert spec.numel_total == catalog_index()[catalog.catalog_id(model_id)]["params_total"] > 0


def test_parameter_counts_agree_with_the_model_cards():
    """issue 37: every catalog config's exact count (meta-device build) within 1% plus the stated rounding of the
    count its model card publishes (SOURCES.md; benchmarks/results/catalog_check.md lists every row)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "catalog_check.py"
    spec = importlib.util.spec_from_file_location("catalog_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rows = check.check(catalog_index())
    cards = [r for r in rows if r["kind"] == "card"]
    assert len(cards) >= 50
    assert [r["model"] for r in cards if not r["ok"]] == []
    assert check.parse_published("card 7.61B; card") == ("card", 7.61e9, pytest.approx(0.005 / 7.61))
    assert check.parse_published("card 110M; card")[0] == "rounded"
    assert check.parse_published('model card "355M"')[0] == "card"
    assert check.parse_published('"8B" (8.03B)')[:2] == ("card", pytest.approx(8.03e9))


def test_variant_and_stored_format_notes():
    from memplan.model.catalog import model_notes

    notes = model_notes(load_spec("meta-llama/Llama-3.1-8B-Instruct"))
    assert notes == [notes[0]] and "answered from meta-llama/Llama-3.1-8B's config.json" in notes[0]
    assert any("stored as MXFP4" in n and "--quant mxfp4" in n for n in model_notes(load_spec("openai/gpt-oss-20b")))
    assert any("stored as fp8" in n for n in model_notes(load_spec("deepseek-ai/DeepSeek-V3")))
    assert model_notes(load_spec("gpt2")) == []


@pytest.mark.parametrize("alias,target", [("gpt2", "openai-community/gpt2"), ("bert-base-uncased",
                         "google-bert/bert-base-uncased"), ("t5-small", "google-t5/t5-small"),
                         ("LLAMA-2-7B-HF", "meta-llama/Llama-2-7b-hf")])
def test_legacy_and_bare_ids(alias, target):
    assert load_spec(alias).model_id == target


def test_catalog_lookup_imports_no_torch():
    code = ("import sys; from memplan.model.catalog import load_spec; s = load_spec('meta-llama/Llama-2-7b-hf'); "
            "print('torch' in sys.modules, s.numel_total)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "6738415616"]


def test_roles_blocks_and_tying():
    spec = load_spec("gpt2")
    roles = {p.role for p in spec.params}
    assert {"embedding", "pos_embedding", "linear", "bias", "norm"} <= roles
    assert spec.tied == (("lm_head.weight", "transformer.wte.weight"),)
    assert {p.block for p in spec.params if p.block is not None} == set(range(12))
    c_attn = next(m for m in spec.linears if m.name == "transformer.h.0.attn.c_attn")
    assert (c_attn.in_features, c_attn.out_features, c_attn.kind) == (768, 2304, "conv1d")
    t5 = load_spec("google/flan-t5-xl")
    assert any(p.role == "lm_head" for p in t5.params) and t5.arch.kind == "seq2seq"
    assert {p.stack for p in t5.params if p.block is not None} == {"encoder", "decoder"}


def test_unknown_model_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError) as info:
        load_spec("someorg/llama-2-7b-hf-finetune")
    assert "config.json" in str(info.value)
    with pytest.raises(NotFound) as info:
        load_spec("lama-2-7b")
    assert "meta-llama/Llama-2-7b-hf" in str(info.value)


def test_malformed_config_names_file_and_key(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8,')
    with pytest.raises(BadInput, match="config.json: not valid JSON"):
        load_spec(bad)
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(BadInput, match="missing key 'model_type'"):
        load_spec(tmp_path)


def test_remote_code_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "my_secret_arch", "auto_map": {"AutoConfig": "x.Cfg"}}))
    with pytest.raises(BadInput, match="--trust-remote-code"):
        load_spec(cfg)


def test_local_config_matches_catalog(tmp_path):
    src = json.loads((catalog.CONFIGS / "openai-community__gpt2.json").read_text())
    src["n_layer"] = 2
    (tmp_path / "config.json").write_text(json.dumps(src))
    spec = load_spec(tmp_path)
    # gpt2 minus 10 blocks of 7,087,872 params each (12 x 7,087,872 + embeddings = 124,439,808)
    assert spec.numel_total == 124_439_808 - 10 * 7_087_872


_GPT2 = "openai-community__gpt2.json"


@pytest.mark.parametrize("override, needle", [
    ({"n_layer": "2"}, "n_layer must be a whole number from 1 to 1,024, got '2'"),
    ({"n_layer": 2.5}, "n_layer must be a whole number"),
    ({"n_layer": float("nan")}, "n_layer must be a whole number"),
    ({"n_layer": 0}, "n_layer must be a whole number"),
    ({"n_layer": -1}, "n_layer must be a whole number"),
    ({"n_layer": 100000}, "n_layer must be a whole number from 1 to 1,024, got 100000"),
    ({"n_head": 0}, "n_head must be a whole number"),
    ({"n_embd": 0}, "n_embd must be a whole number"),
    ({"n_embd": -64}, "n_embd must be a whole number"),
    ({"n_embd": float("inf")}, "n_embd must be a whole number"),
    ({"n_embd": 10**9}, "n_embd must be a whole number from 1 to 1,048,576"),
    ({"vocab_size": 0}, "vocab_size must be a whole number"),
    ({"vocab_size": -5}, "vocab_size must be a whole number"),
    ({"torch_dtype": "float128"}, "torch_dtype must be a torch dtype name"),
    ({"model_type": ["gpt2"]}, "model_type must be a non-empty string"),
    ({"n_embd": 770}, "is not a multiple of num_attention_heads 12"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'"),
])
def test_unusable_configs_exit_2_naming_the_field(tmp_path, override, needle):
    """issue 41, defect 5: each was a traceback, a hang (100,000 layers ran past 120 s) or an answer for a degenerate
    model; now exit 2 with the field, its value and its range, before transformers builds anything."""
    import time

    from click.testing import CliRunner

    from memplan.cli.main import main

    src = json.loads((catalog.CONFIGS / _GPT2).read_text())
    (tmp_path / "config.json").write_text(json.dumps({**src, **override}))
    start = time.perf_counter()
    r = CliRunner().invoke(main, ["estimate", str(tmp_path / "config.json")])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("content, needle", [
    (json.dumps({"model_type": "gpt2", "name": "é"}, ensure_ascii=False).encode("latin-1"), "not UTF-8 text"),
    (json.dumps({"model_type": "gpt2"}).encode("utf-16"), "not UTF-8 text"),
    (b"\x00\x01\x02\xff", "not UTF-8 text"),
    (b'{"model_type": "gpt2", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
])
def test_unreadable_config_files_exit_2(tmp_path, content, needle):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(BadInput, match=needle):
        load_spec(tmp_path / "config.json")


def test_every_known_config_passes_the_config_rules():
    """No false alarm: the catalog's configs and the family shapes all pass memplan.model.config_rules."""
    from pathlib import Path

    from memplan.model.config_rules import config_problems

    root = Path(__file__).resolve().parents[2]
    paths = sorted(catalog.CONFIGS.glob("*.json")) + sorted((root / "benchmarks" / "shapes").rglob("config.json"))
    assert len(paths) > 80
    assert {str(p): config_problems(json.loads(p.read_text())) for p in paths
            if config_problems(json.loads(p.read_text()))} == {}


def test_offline_message_keeps_a_dotted_model_id_whole(monkeypatch):
    """issue 42: the message was split on the first "." of the id ("...(memplan estimate ./config.json).2'")."""
    monkeypatch.setattr(catalog, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(OfflineError) as e:
        load_spec("mistralai/Mistral-7B-Instruct-v0.9")
    text = str(e.value)
    assert text.startswith("'mistralai/Mistral-7B-Instruct-v0.9' is not in the built-in catalog")
    assert text.count("Mistral-7B-Instruct-v0.9") == 1 and "./config.json). Did you mean: mistralai/Mistral-7B-" \
        in text


def test_a_quantized_upload_answers_with_its_base_architecture():
    """issue 37: a -bnb-4bit upload (any organisation's) is its base model's architecture stored as bitsandbytes
    NF4; the estimate needs that quant. GPTQ/AWQ/FP8/compressed-tensors FP8/torchao uploads resolve to their stored
    format (issue 40); formats not modelled yet (MXFP4 outside gpt-oss) say so, naming the base."""
    from memplan.setup import Setup
    from memplan.model.compat import setup_problems

    spec = load_spec("unsloth/Qwen2.5-7B-bnb-4bit")
    base = load_spec("Qwen/Qwen2.5-7B")
    assert (spec.variant_of, spec.checkpoint_quant, spec.numel_total) == ("Qwen/Qwen2.5-7B", "nf4", base.numel_total)
    assert any("--quant nf4" in p for p in setup_problems(spec, Setup(technique="lora")))
    assert setup_problems(spec, Setup(technique="qlora")) == []
    for name, quant in (("Qwen/Qwen2.5-7B-GPTQ-Int4", "gptq-int4"), ("Qwen/Qwen2.5-7B-AWQ", "awq"),
                        ("Qwen/Qwen2.5-7B-FP8", "fp8"), ("Qwen/Qwen2.5-7B-FP8-Dynamic", "fp8-dynamic"),
                        ("Qwen/Qwen2.5-7B-int4wo-hqq", "torchao-int4")):
        assert load_spec(name).checkpoint_quant == quant
    for name in ("Qwen/Qwen2.5-7B-MXFP4",):
        with pytest.raises(BadInput, match="upload of Qwen/Qwen2.5-7B; memplan does not model pre-quantized"):
            load_spec(name)


def test_cli_applies_the_uploads_quant_and_says_so():
    from click.testing import CliRunner

    from memplan.cli.main import main

    r = CliRunner().invoke(main, ["estimate", "unsloth/Qwen2.5-7B-bnb-4bit", "--technique", "qlora", "--json"])
    assert r.exit_code == 0, r.output
    assert "note: unsloth/Qwen2.5-7B-bnb-4bit: the architecture of Qwen/Qwen2.5-7B" in r.stderr
    assert json.loads(r.stdout)["setup"]["quant"] == "nf4"


@pytest.mark.parametrize("args, present, absent", [
    (["--search", "qwen2.5-7"], ["Qwen/Qwen2.5-7B"], ["Qwen/Qwen2.5-0.5B", "openai-community/gpt2"]),
    (["--family", "T5"], ["google-t5/t5-small", "google/flan-t5-xl"], ["Qwen/Qwen2.5-7B"]),
    (["--search", "gpt2", "--family", "gpt2"], ["openai-community/gpt2-xl"], ["bigcode/starcoder"]),
])
def test_models_search_and_family(args, present, absent):
    from click.testing import CliRunner

    from memplan.cli.main import main

    r = CliRunner().invoke(main, ["models", *args, "--json"])
    assert r.exit_code == 0, r.output
    ids = set(json.loads(r.stdout))
    assert set(present) <= ids and not ids & set(absent)


def test_models_unknown_family_exits_2_with_suggestions():
    from click.testing import CliRunner

    from memplan.cli.main import main

    r = CliRunner().invoke(main, ["models", "--family", "qwen9"])
    assert r.exit_code == 2 and "Did you mean: qwen3, qwen2" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("model_id, irregular", [
    ("deepseek-ai/DeepSeek-V3", 3),  # first_k_dense_replace: 3 dense blocks before the MoE ones
    ("deepseek-ai/DeepSeek-V2-Lite", 1), ("google-t5/t5-small", 1),  # the first block differs (T5: position bias)
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", 47),  # dense and MoE blocks alternate: no cut repeats
    ("meta-llama/Llama-3.1-8B", 0), ("Qwen/Qwen3-30B-A3B", 0)])
def test_leading_irregular_blocks(model_id, irregular):
    """A cut trace (--layers) repeats its last block to the full depth: it must reach past the blocks that
    differ (the catalog survey traced DeepSeek-V3 cut to 2 and 3 dense blocks and was 29x under the estimate)."""
    from memplan.tracer.training import leading_irregular_blocks

    assert leading_irregular_blocks(load_spec(model_id)) == irregular


@pytest.mark.slow  # builds two inventories (~20 s)
def test_a_local_config_is_built_once_and_cached_by_content(tmp_path, monkeypatch):
    """Issue 42 item 7: a local config.json cost ~6-16 s on every call. Its inventory is cached under the hash of
    its bytes (and the libraries' releases): a copy elsewhere reads it, an edit builds anew."""
    import json
    import time
    from pathlib import Path

    from memplan.model import catalog
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))
    configs = Path(__file__).resolve().parents[2] / "memplan" / "data" / "models" / "configs"
    src = configs / "openai-community__gpt2.json"
    a, b = tmp_path / "a" / "config.json", tmp_path / "b" / "config.json"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text(src.read_text())
    first = catalog.load_spec(str(a))
    assert len(list((tmp_path / "cache" / "inventories").glob("*.json"))) == 1
    catalog._build_cached.cache_clear()
    t0 = time.perf_counter()
    again = catalog.load_spec(str(b))
    assert time.perf_counter() - t0 < 1.0
    assert again.model_id == str(b.resolve()) and again.params == first.params
    edited = json.loads(src.read_text()) | {"n_layer": 2}
    b.write_text(json.dumps(edited))
    catalog._build_cached.cache_clear()
    assert catalog.load_spec(str(b)).arch.num_layers == 2
    assert len(list((tmp_path / "cache" / "inventories").glob("*.json"))) == 2


def test_parameter_counts_print_as_cards_write_them():
    """Gemma-3-1B's 999.9M parameters printed as "1e+03M" in `memplan models` (session 30)."""
    from memplan.units import fmt_count
    assert [fmt_count(n) for n in (999_885_952, 6_738_415_616, 124_439_808, 268_098_176, 999)] == \
        ["1B", "6.74B", "124M", "268M", "999"]
