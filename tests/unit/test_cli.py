"""CLI through click's CliRunner: text and --json contracts, exit codes, clean errors."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memplan.cli.main import main


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args))


def test_estimate_json_contract(run):
    r = run("estimate", "gpt2", "--technique", "lora", "--lora-targets", "c_attn,c_proj", "--precision", "bf16",
            "--batch-size", "2", "--seq-len", "128", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"model", "params_total", "params_trainable", "setup", "components", "peak_allocated_bytes",
            "peak_reserved_bytes", "device_total_bytes"} <= set(d)
    assert d["model"] == "openai-community/gpt2" and d["params_total"] == 124_439_808
    assert d["setup"]["lora_targets"] == ["c_attn", "c_proj"] and d["setup"]["batch_size"] == 2
    assert d["peak_allocated_bytes"] <= d["peak_reserved_bytes"] <= d["device_total_bytes"]
    assert all(isinstance(v, int) for v in d["components"].values())


def test_estimate_text(run):
    r = run("estimate", "meta-llama/Llama-2-7b-hf", "--technique", "qlora", "--double-quant", "--grad-ckpt")
    assert r.exit_code == 0, r.output
    assert "peak allocated" in r.output and "GiB" in r.output and "quant state" in r.output


def test_fit_json_contract(run):
    r = run("fit", "meta-llama/Llama-2-7b-hf", "--gpu", "RTX 3060", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["gpu"] == {"name": "GeForce RTX 3060 12GB", "memory_bytes": 12 * 2**30}
    # issue 39: DoRA, Liger, offloading; 38: SFT, DPO, GRPO; 40: a GPTQ upload served; TRL's QLoRA (session 34)
    assert len(d["options"]) == 15
    for row in d["options"]:
        assert {"option", "mode", "setup", "fits", "max_batch_size", "need_bytes_at_batch_1",
                "device_total_bytes_at_batch_1"} <= set(row)
        assert row["mode"] in ("train", "infer") and isinstance(row["max_batch_size"], int)
        assert row["fits"] == (row["max_batch_size"] > 0)
    by_name = {row["option"]: row for row in d["options"]}
    assert by_name["full fine-tune (bf16-mixed, AdamW)"]["fits"] is False  # 7B x 16 B/param >> 12 GiB
    assert by_name["QLoRA nf4 (double quant, paged 8-bit AdamW, checkpointing)"]["fits"] is True
    # TRL prepares no k-bit model (16-bit embeddings and head) and scores through its fused head: more batch
    trl = by_name["TRL SFT, QLoRA nf4 (bf16 compute), checkpointing"]
    assert trl["max_batch_size"] > by_name["QLoRA nf4 (double quant, paged 8-bit AdamW, checkpointing)"]["max_batch_size"]


def test_fit_nothing_fits_exits_1(run):
    r = run("fit", "meta-llama/Llama-2-70b-hf", "--memory", "4GiB")
    assert r.exit_code == 1
    assert "No option fits" in r.output


def test_fit_t4_uses_fp16(run):
    r = run("fit", "gpt2", "--gpu", "t4", "--json")
    assert r.exit_code == 0
    assert all("bf16" not in row["setup"]["precision"] for row in json.loads(r.output)["options"])


@pytest.mark.parametrize("args,needle", [
    (("estimate", "llama-7"), "unknown model"),
    (("fit", "gpt2", "--gpu", "voodoo5"), "unknown GPU"),
    (("estimate", "gpt2", "--batch-size", "0"), "batch_size must be an integer from 1 to 1,048,576"),
    (("estimate", "gpt2", "--seq-len", "4096"), "max_position_embeddings (1024)"),
    (("estimate", "gpt2", "--technique", "lora", "--lora-targets", "q_proj"), "c_attn"),
    (("fit", "gpt2", "--gpu", "3060", "--memory", "12GiB"), "either --gpu or --memory"),
    # issue 41's numbers: each a traceback (OverflowError, ValueError, ZeroDivisionError) or a wrong answer before
    (("estimate", "gpt2", "--batch-size", "9" * 400), "batch_size must be an integer from 1 to 1,048,576, got a 400"),
    (("estimate", "gpt2", "--mode", "infer", "--prompt-len", "9" * 400), "prompt_len must be an integer from 1"),
    (("fit", "gpt2", "--memory", "9" * 400), "memory size must be from 1 byte to 1 EiB"),
    (("fit", "gpt2", "--memory", "0.5b"), "memory size must be from 1 byte to 1 EiB"),
    (("plan", "gpt2", "--gpu", "t4", "--host-memory", "abc"), "--host-memory: cannot read 'abc'"),
    (("plan", "gpt2", "--gpu", "t4", "--host-memory", "0"), "--host-memory: memory size must be from 1 byte"),
    (("plan", "gpt2", "--gpu", "t4", "--host-memory", "-1GiB"), "--host-memory: cannot read"),
    (("plan", "gpt2", "--gpu", "t4", "--num-gpus", "0"), "num_gpus must be an integer from 1 to 65,536"),
    (("plot", "gpt2", "--x", "batch_size", "--values", "1000000000000", "-o", "x.png"), "batch_size must be"),
    (("plot", "gpt2", "--x", "batch_size", "--values", "", "-o", "x.png"), "--values '': give whole numbers"),
    (("fit", "gpt2", "--memory", "24GB", "--num-gpus", "9" * 40), "not in the range 1<=x<=65536"),
    (("fit", "gpt2", "--gpu", "t4", "--headroom", "nan"), "must be in [0%, 100%), got 'nan'"),
    (("fit", "gpt2", "--gpu", "t4", "--headroom", "-5%"), "must be in [0%, 100%), got '-5%'"),
    (("plot", "gpt2", "--memory", "", "--x", "batch_size", "-o", "x.png"), "--memory is empty"),
    (("doctor", "gpt2", "--gpu", ""), "--gpu is empty"),
    # issue 41's silently ignored flags
    (("estimate", "gpt2", "--lora-r", "16"), "--lora-r sets a LoRA adapter, which --technique full does not train"),
    (("estimate", "gpt2", "--technique", "freeze", "--lora-dropout", "0.1"), "--lora-dropout sets a LoRA adapter"),
    (("estimate", "gpt2", "--prompt-len", "64"), "--prompt-len applies to --mode infer only"),
    (("estimate", "gpt2", "--double-quant"), "double_quant applies to 4-bit quantization only"),
    (("estimate", "gpt2", "--attn-impl", "flash_attention_2"), "flash_attention_2 runs in fp16/bf16 only"),
])
def test_bad_input_exit_2_without_traceback(run, args, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_all_setup_problems_reported_together(run):
    r = run("estimate", "gpt2", "--batch-size", "0", "--grad-accum", "0", "--technique", "full", "--quant", "nf4")
    assert r.exit_code == 2
    assert "3 problem(s)" in r.output


def test_click_usage_error_is_exit_2(run):
    assert run("estimate", "gpt2", "--precision", "fp8").exit_code == 2


def test_listings(run):
    r = run("models", "--json")
    assert r.exit_code == 0 and "meta-llama/Llama-2-7b-hf" in json.loads(r.output)
    r = run("gpus")
    assert r.exit_code == 0 and "RTX 4090" in r.output
    assert run("models").exit_code == 0


@pytest.mark.parametrize("cmd,ids", [("models", ["HuggingFaceTB/SmolLM2-1.7B", "bigcode/gpt_bigcode-santacoder"]),
                                     ("gpus", ["GeForce RTX 4090", "Tesla V100 16GB"])])
def test_listings_never_cut_ids_on_a_narrow_terminal(cmd, ids, monkeypatch):
    """Names the user copies into the next command stay whole in an 80-column terminal (rich used to cut them to
    'bigcode/gpt_big…')."""
    monkeypatch.setenv("COLUMNS", "80")
    r = CliRunner().invoke(main, [cmd])
    assert r.exit_code == 0 and "…" not in r.output
    for name in ids:
        assert name in r.output


def test_no_gpu_detected_message(run, monkeypatch):
    import memplan.gpus
    monkeypatch.setattr(memplan.gpus, "detect_gpus", lambda: [])
    r = run("fit", "gpt2")
    assert r.exit_code == 2 and "--gpu" in r.output and "--memory" in r.output


@pytest.mark.parametrize("model_type, code, needle", [
    ("gemma3", 0, "never run"),  # a vision-language config: estimated for text-only steps (tests/test_composite.py)
    ("t5gemma", 2, "one of its language"),  # no hidden size of its own: a TypeError inside the inventory before
    ("gemma4", 2, "per_layer_config"),  # attention shapes per layer: refused, not under-counted
])
def test_composite_configs_are_estimated_or_refused_with_what_to_pass(run, tmp_path, model_type, code, needle):
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_diff_dict()
    d["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(d))
    r = run("estimate", str(tmp_path / "config.json"), "--technique", "qlora", "--precision", "bf16",
            "--lora-targets", "all-linear")
    assert r.exit_code == code and needle in " ".join(r.output.split()) and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("out, needle", [("afile/rows.csv", "afile is a file, not a folder"), (".", "is a directory")])
def test_an_unwritable_out_is_refused_before_anything_is_measured(run, tmp_path, monkeypatch, out, needle):
    """issue 41: with --out unwritable the whole measurement ran, then a traceback lost its result."""
    import memplan.cli.measure as measure_cli

    def must_not_run(*args, **kwargs):
        raise AssertionError("measured before checking --out")
    monkeypatch.setattr(measure_cli, "validate", must_not_run)
    monkeypatch.setattr(measure_cli, "run_sweep", must_not_run)
    (tmp_path / "afile").write_text("")
    sweep = tmp_path / "s.yaml"
    sweep.write_text("models: [gpt2]\nmatrix: {batch_size: [1]}\n")
    target = str(tmp_path / out)
    for args in (["validate", "gpt2", "--device", "cpu", "--out", target],
                 ["validate", "--sweep", str(sweep), "--device", "cpu", "--out", target]):
        r = run(*args)
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output


def test_bitsandbytes_optional_kernel_notice_is_not_printed(caplog):
    """issue 41: every model build printed bitsandbytes' "Failed to load CPU gemm_4bit_forward from
    kernels-community" to stderr (an optional speed-up), which users read as a failure; its other warnings stay."""
    import logging

    import memplan.runtime.steps  # noqa: F401  (installs the filter, as every model build does)
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        log.warning("another bitsandbytes warning")
    assert "kernels-community" not in caplog.text and "another bitsandbytes warning" in caplog.text


def test_check_refuses_unreadable_inputs_and_reports_unreadable_rows(run, tmp_path):
    """issue 41, defect 7: binary bytes and NaN tracebacks, --report '' or under /proc, --tolerance 150% named
    --memory-fraction, and memplan.check("file.csv") walked the filesystem from / (a string's characters)."""
    import memplan

    report = str(tmp_path / "r.md")
    (tmp_path / "bin.csv").write_bytes(b"model\n\xff\xfe\x00")
    (tmp_path / "nan.csv").write_text("model,status,measured_allocated_bytes\ngpt2,ok,nan\n")
    r = run("check", str(tmp_path / "bin.csv"), "--report", report)
    assert r.exit_code == 2 and "is not UTF-8 text" in r.output, r.output
    for args, needle in ((("--report", ""), "is a folder"), (("--report", "/proc/memplan/x.md"), "cannot write --report"),
                         (("--tolerance", "150%"), "--tolerance must be in (0%, 100%]")):
        r = run("check", str(tmp_path / "nan.csv"), *args)
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    r = run("check", str(tmp_path / "nan.csv"), "--report", report)
    assert r.exit_code == 1 and "unreadable row" in (tmp_path / "r.md").read_text(), r.output
    result = memplan.check(str(tmp_path / "nan.csv"))  # one file, not the characters of its name
    assert [row.file for row in result.rows] == [str(tmp_path / "nan.csv")]


def test_api_arguments_of_the_wrong_kind_raise_memplans_errors():
    """issue 41's API cases: find_gpu(12) raised AttributeError, diagnose(budget="12GiB") ValueError, and
    diagnose(budget=0) answered."""
    import memplan
    from memplan.errors import BadInput

    with pytest.raises(BadInput, match="a GPU name is text"):
        memplan.find_gpu(12)
    for budget in ("12GiB", 0, -5):
        with pytest.raises(BadInput, match="budget_bytes must be a positive whole number"):
            memplan.diagnose(memplan.load_spec("gpt2"), memplan.Setup(), budget)


def test_a_local_folder_shadowing_a_catalog_id_is_named(tmp_path, monkeypatch):
    """issue 41, defect 9: a ./gpt2 folder silently replaced the catalog's gpt2; the command now says which it read."""
    import json as json_module

    from memplan.model import catalog

    (tmp_path / "gpt2").mkdir()
    src = json_module.loads((catalog.CONFIGS / "openai-community__gpt2.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json_module.dumps({**src, "n_layer": 2}))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["estimate", "gpt2"])
    assert r.exit_code == 0 and "using the local gpt2" in r.stderr and "not the catalog's openai-community/gpt2" \
        in r.stderr, r.output


def test_inference_header_and_length_error_name_the_prompt(run):
    """issue 42 item 8: the inference header said "seq 512" when --prompt-len was given, and a prompt too long
    for the model was told to shorten --seq-len."""
    r = run("estimate", "gpt2", "--mode", "infer", "--prompt-len", "900", "--new-tokens", "64")
    assert r.exit_code == 0 and "batch 8 x prompt 900 + 64 new" in r.output, r.output
    r = run("estimate", "gpt2", "--mode", "infer", "--prompt-len", "1024", "--new-tokens", "64")
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "prompt 1024 + 64 new tokens = 1088 exceed" in text and "--prompt-len + --new-tokens" \
        in text, r.output


def test_fit_starts_with_a_one_line_verdict(run):
    """Issue 42 item 7: the answer first, then the table (QLoRA is what fits Llama-2-7B on a 12 GB card)."""
    r = run("fit", "meta-llama/Llama-2-7b-hf", "--gpu", "RTX 3060")
    first = r.output.splitlines()[0]
    assert first.startswith("fits: meta-llama/Llama-2-7b-hf on GeForce RTX 3060 12GB"), first
    assert "trains with QLoRA nf4" in first and "full fine-tune" not in first.split("serves")[0]
    r = run("fit", "meta-llama/Llama-2-70b-hf", "--gpu", "RTX 3060")
    assert r.exit_code == 1 and r.output.startswith("does not fit:") and "fewest GPUs to train:" in r.output


@pytest.mark.parametrize("cmd", [("fit", "gpt2", "--gpu", "t4"), ("estimate", "gpt2"),
                                 ("models", "--search", "qwen3-0"), ("gpus",)])
def test_markdown_and_csv_formats(run, cmd):
    """--format markdown prints pipe tables, --format csv parses with pandas (titles as # comments, notes on
    stderr); the same cells as the terminal table, never wrapped."""
    import io

    import pandas as pd
    md = run(*cmd, "--format", "markdown")
    assert md.exit_code == 0, md.output
    assert "|---|" in md.output and "┃" not in md.output
    runner = CliRunner()
    csv = runner.invoke(main, [*cmd, "--format", "csv"])
    assert csv.exit_code == 0, csv.output
    tables = [t for t in csv.stdout.split("# ") if t.strip()]
    frame = pd.read_csv(io.StringIO(tables[0].split("\n", 1)[1]))
    assert len(frame) >= 2 and not frame.columns.str.contains("Unnamed").any()
    assert json.loads(run(*cmd, "--format", "json").output) == json.loads(run(*cmd, "--json").output)


def test_piped_tables_are_full_width(run, monkeypatch):
    """A table printed to a pipe is not wrapped at rich's 80 columns (issue 42 item 7); COLUMNS still rules."""
    monkeypatch.delenv("COLUMNS", raising=False)
    r = run("fit", "gpt2", "--gpu", "t4")
    row = next(line for line in r.output.splitlines()
               if line.startswith("│ QLoRA nf4 (double quant, paged 8-bit AdamW, checkpointing)"))
    assert "yes" in row


def test_python_frames():
    """pandas DataFrames from the API: a grid of estimates, an estimate's components, a fit table."""
    import memplan
    df = memplan.frame(["gpt2", "Qwen/Qwen3-0.6B"], [dict(batch_size=b) for b in (1, 8)], technique="lora")
    assert len(df) == 4 and set(df["batch_size"]) == {1, 8} and (df["technique"] == "lora").all()
    one = memplan.estimate("gpt2", technique="lora", batch_size=8)
    assert df.loc[1, "peak_allocated_bytes"] == one.peak_allocated_bytes
    comp = one.to_frame()
    assert comp["bytes"].sum() == sum(one.components.values())
    fit = memplan.fit(memplan.load_spec("gpt2"), memplan.find_gpu("t4"), seq_len=512).to_frame()
    assert {"option", "fits", "max_batch_size", "technique"} <= set(fit.columns)


def test_check_lists_predicted_ooms_after_the_measured_rows(run, tmp_path):
    """Issue 42 item 8: a run that hit its cap and was predicted to (an OOM "pass") printed "+250.5%" and led the
    worst-first list; it now says "OOM predicted" and follows the rows with a measured peak."""
    import csv
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "data" / "measured" / "gpu-h100.csv"
    rows = list(csv.DictReader(src.open()))
    oom = next(r for r in rows if r["status"] == "oom" and r["memory_limit_bytes"])
    ok = next(r for r in rows if r["status"] == "ok" and r["model"] == "openai-community/gpt2")
    out = tmp_path / "rows.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows([oom, ok])
    r = run("check", str(out), "--report", str(tmp_path / "r.md"), "--format", "csv")
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if line[:1].isdigit()]
    assert "openai-community/gpt2" in lines[0] and "OOM predicted" in lines[1] and "%" not in lines[1].split(",")[-2]


@pytest.mark.slow  # builds the classification inventories (~10 s each)
def test_task_builds_the_classification_head(run):
    """--task seq-cls (issue 42): BERT with its pooler and a 2-way classifier instead of the MLM head (335,143,938
    parameters, as the published bert-large rows' AutoModelForSequenceClassification holds: 335M), no vocabulary
    logits; a task the family has no class for is a clean error."""
    r = run("estimate", "google-bert/bert-large-uncased", "--task", "seq-cls", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["params_total"] == 335_143_938 and d["components"]["logits"] == 0 and d["setup"]["task"] == "seq-cls"
    mlm = json.loads(run("estimate", "google-bert/bert-large-uncased", "--json").output)
    assert mlm["components"]["logits"] > 0 and mlm["setup"]["task"] is None
    r = run("estimate", "gpt2", "--task", "seq2seq")
    assert r.exit_code == 2 and "no AutoModelForSeq2SeqLM class for model type 'gpt2'" in r.output
    fit = json.loads(run("fit", "google-bert/bert-large-uncased", "--task", "seq-cls", "--gpu", "t4", "--json").output)
    serve = next(o for o in fit["options"] if o["mode"] == "infer")
    assert serve["setup"]["new_tokens"] == 0 and fit["options"][0]["fits"]  # a classifier serves one forward
    assert "Traceback" not in r.output


@pytest.mark.slow
def test_task_labels_match_the_head():
    """The traced and measured steps feed a classification head labels per sample or per token, in range."""
    from memplan.model.catalog import load_spec
    from memplan.runtime.steps import classifier_labels, make_batch
    from memplan.setup import Setup
    setup = Setup(batch_size=3, seq_len=16)
    seq = load_spec("google-bert/bert-base-uncased", task="seq-cls")
    tok = load_spec("FacebookAI/roberta-base", task="token-cls")
    assert classifier_labels(seq) == 2 and classifier_labels(load_spec("gpt2")) == 0
    assert tuple(make_batch(seq, setup, 100)["labels"].shape) == (3,)
    labels = make_batch(tok, setup, 100)["labels"]
    assert tuple(labels.shape) == (3, 16) and int(labels.max()) < classifier_labels(tok)


def test_notebooks_get_html_tables():
    """A notebook cell ending in an estimate or a fit table renders it (issue 42 item 7: a rich display)."""
    import memplan
    e = memplan.estimate("gpt2", technique="lora")
    assert e._repr_html_().startswith("<b>openai-community/gpt2</b>: peak allocated") and "<table" in e._repr_html_()
    fit = memplan.fit(memplan.load_spec("gpt2"), memplan.find_gpu("t4"), seq_len=512)
    assert "QLoRA nf4" in fit._repr_html_() and "<table" in fit._repr_html_()
