"""memplan doctor: OOM messages parsed to the byte, remedies ranked by how small a change they are, the CLI."""
from __future__ import annotations

import json
from dataclasses import replace

import click
import pytest
from click.testing import CliRunner

from memplan.planner.budget import budget_bytes
from memplan.cli.doctor import doctor_command
from memplan.planner.doctor import diagnose, rank_key
from memplan.planner.oom import parse_oom_message
from memplan.errors import BadInput
from memplan.estimator.breakdown import estimate
from memplan.planner.export import write_plan
from memplan.gpus import find_gpu
from memplan.model.catalog import load_spec
from memplan.planner.search import plan
from memplan.setup import Setup
from memplan.units import GiB, MiB

NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of "
       "79.15 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use. "
       "Of the allocated memory 75.02 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.76 GiB total capacity; 10.12 GiB "
       "already allocated; 7.69 MiB free; 10.24 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
       "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
       "PYTORCH_CUDA_ALLOC_CONF")


def _b(x: float, unit: int) -> int:
    return int(round(x * unit))


def _group() -> click.Group:
    g = click.Group()
    g.add_command(doctor_command)
    return g


def _run(*args):
    return CliRunner(env={"COLUMNS": "250"}).invoke(_group(), ["doctor", *args])


# --------------------------------------------------------------------------------------------- OOM messages

def test_parse_current_message_to_the_byte():
    o = parse_oom_message(NEW)
    assert o.tried_to_allocate_bytes == _b(1.96, GiB) and o.total_capacity_bytes == _b(79.15, GiB)
    assert o.free_bytes == _b(1.21, GiB) and o.process_in_use_bytes == _b(77.93, GiB)
    assert o.allocated_by_pytorch_bytes == _b(75.02, GiB) and o.reserved_unallocated_bytes == _b(2.41, GiB)
    assert o.gpu_index == 0 and o.other_processes_bytes is None


def test_parse_old_message_and_wrapped_lines():
    o = parse_oom_message(OLD.replace("; ", ";\n  "))
    assert o.tried_to_allocate_bytes == 20 * 2**20 and o.total_capacity_bytes == _b(11.76, GiB)
    assert o.allocated_by_pytorch_bytes == _b(10.12, GiB) and o.free_bytes == _b(7.69, MiB)
    assert o.reserved_unallocated_bytes == _b(10.24, GiB) - _b(10.12, GiB)
    assert o.process_in_use_bytes is None and o.gpu_index == 0


def test_parse_units_typo_and_other_processes():
    o = parse_oom_message("CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacty of 23.69 GiB "
                          "of which 0 bytes is free. Process 2006998 has 256.00 MiB memory in use. Including "
                          "non-PyTorch memory, this process has 18.17 GiB memory in use. Of the allocated memory "
                          "3.50 KiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")
    assert o.tried_to_allocate_bytes == 512 and o.free_bytes == 0 and o.gpu_index == 1
    assert o.allocated_by_pytorch_bytes == 3584 and o.reserved_unallocated_bytes == 0
    assert o.other_processes_bytes == 256 * MiB and o.process_in_use_bytes == _b(18.17, GiB)


@pytest.mark.parametrize("text", ["", "RuntimeError: expected scalar type Float but found Half",
                                  "CUDA error: out of memory"])
def test_non_oom_text_is_bad_input(text):
    with pytest.raises(BadInput, match="not a PyTorch out-of-memory message"):
        parse_oom_message(text)


# --------------------------------------------------------------------------------------------- diagnose

def test_llama2_7b_full_on_rtx_3060_leads_with_a_change_that_fits():
    spec, gpu = load_spec("meta-llama/Llama-2-7b-hf"), find_gpu("RTX 3060")
    setup = Setup(technique="full")
    d = diagnose(spec, setup, gpu.memory_bytes)
    assert not d.fits and d.resolved and d.exit_code == 0
    final = d.fix[-1]
    assert final.fits and estimate(spec, final.setup).cap_need_bytes <= gpu.memory_bytes
    assert d.first_line.startswith("Smallest change that fits: ") and final.description in d.first_line
    # every step of a combination is needed: without any one of them it no longer fits
    from memplan.planner.remedies import chain, RemedyContext
    c = RemedyContext(spec, gpu.memory_bytes, estimate, True)
    for step in d.combination:
        rest = chain(setup, d.need_bytes, [r.order for r in d.combination if r is not step], c)
        assert not rest or not rest[-1].fits


def test_smaller_change_ranks_first_when_two_fit():
    """gpt2 full fp32 batch 8 x 512: checkpointing (a knob) and QLoRA (a new technique) both fit 7.5 GiB."""
    spec, setup, budget = load_spec("openai-community/gpt2"), Setup(), int(7.5 * GiB)
    d = diagnose(spec, setup, budget)
    fitting = [r.name for r in d.remedies if r.fits]
    assert "grad-ckpt" in fitting and "qlora" in fitting
    assert fitting.index("grad-ckpt") < fitting.index("qlora")
    assert [rank_key(r) for r in d.remedies if r.fits] == sorted(rank_key(r) for r in d.remedies if r.fits)
    assert d.best.size == 1 and d.first_line.startswith("Smallest change that fits")
    assert all(r.saved_bytes == d.need_bytes - r.need_bytes for r in d.remedies)


def test_two_knobs_beat_truncating_the_data():
    """Llama-2-7B QLoRA at 16 x 1024 on 12 GiB: the only single fix is truncating the samples (size 5); checkpointing
    plus a smaller micro-batch (two size-1 knobs) is the smaller change and leads."""
    spec, budget = load_spec("meta-llama/Llama-2-7b-hf"), 12 * GiB
    d = diagnose(spec, Setup(technique="qlora", batch_size=16, seq_len=1024), budget)
    assert d.best.name == "shorter-sequences"
    assert len(d.fix) > 1 and max(r.size for r in d.fix) < d.best.size and d.fix[-1].fits
    assert estimate(spec, d.fix[-1].setup).cap_need_bytes <= budget
    assert d.fix[-1].setup.seq_len == 1024 and d.fix[-1].setup.batch_size * d.fix[-1].setup.grad_accum == 16
    assert "smaller changes than the best single one" in d.first_line


def test_already_fits_and_barely_fits():
    spec, setup = load_spec("openai-community/gpt2"), Setup(batch_size=2, seq_len=256)
    total = estimate(spec, setup).cap_need_bytes  # what doctor, fit and plan test against the budget
    d = diagnose(spec, setup, 2 * total)
    assert d.fits and not d.barely_fits and not d.remedies and d.first_line.startswith("Fits")
    d = diagnose(spec, setup, int(total * 1.02))
    assert d.barely_fits and d.remedies and d.first_line.startswith("Barely fits")
    assert all(r.saved_bytes > 0 for r in d.remedies) and d.exit_code == 0


def test_nothing_fits_exit_1_and_inference_refused():
    d = diagnose(load_spec("meta-llama/Llama-2-70b-hf"), Setup(), 4 * GiB)
    assert not d.resolved and d.exit_code == 1 and d.first_line.startswith("Nothing fits")
    with pytest.raises(BadInput, match="training"):
        diagnose(load_spec("gpt2"), Setup(mode="infer"), 4 * GiB)


def test_halving_keeps_the_effective_batch_and_eager_gets_sdpa():
    spec = load_spec("openai-community/gpt2")
    d = diagnose(spec, Setup(batch_size=8, grad_accum=2, attn_impl="eager"), 6 * GiB)
    by = {r.name: r for r in d.remedies}
    half = by["halve-batch"].setup
    assert (half.batch_size, half.grad_accum) == (4, 4)
    assert by["sdpa"].setup.attn_impl == "sdpa" and by["sdpa"].saved_bytes > 0


def test_oom_fragmentation_adds_the_allocator_remedy_without_estimate():
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    oom = parse_oom_message(NEW.replace("2.41 GiB is reserved", "12.41 GiB is reserved"))
    d = diagnose(spec, Setup(technique="full", precision="bf16-mixed"), oom.total_capacity_bytes, oom=oom)
    alloc = [r for r in d.remedies if r.name == "expandable-segments"]
    assert alloc and alloc[0].need_bytes is None and alloc[0].fits is None
    assert "no estimate" in alloc[0].cost and any(n.startswith("measured") for n in d.notes)
    assert d.best is None or d.best.name != "expandable-segments"


# --------------------------------------------------------------------------------------------- CLI

def test_cli_llama_full_on_rtx_3060():
    r = _run("meta-llama/Llama-2-7b-hf", "--technique", "full", "--gpu", "RTX 3060")
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    budget = budget_bytes(find_gpu("RTX 3060").memory_bytes)  # 12 GiB less the 3.5% headroom, as fit and plan
    assert first.startswith("Smallest change that fits: ") and f"of {budget / GiB:.2f} GiB" in first


def test_cli_oom_message_sets_budget_and_reports_measured():
    r = _run("meta-llama/Llama-2-7b-hf", "--precision", "bf16-mixed", "--batch-size", "4", "--oom-message", NEW,
             "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["budget_bytes"] == budget_bytes(_b(79.15, GiB)) and d["oom"]["process_in_use_bytes"] == _b(77.93, GiB)
    assert "total capacity in the OOM message: 79.15 GiB less 3.5% headroom" == d["budget_source"]
    assert any("measured" in n for n in d["notes"]) and d["first_line"]


def test_cli_oom_file(tmp_path):
    f = tmp_path / "err.txt"
    f.write_text("Traceback (most recent call last):\n  ...\n" + OLD + "\n")
    r = _run("openai-community/gpt2", "--oom-file", str(f))
    assert r.exit_code == 0, r.output
    assert "11.76 GiB" in r.output and r.output.startswith("Estimated to fit")  # the run did not: remedies follow
    flat = " ".join(r.output.split())
    assert "measured: PyTorch had reserved 10.24 GiB" in flat
    assert "expandable_segments" not in flat  # 0.12 of 10.24 GiB reserved is unallocated: not fragmented


def test_cli_from_plan_file_and_override(tmp_path):
    spec = load_spec("openai-community/gpt2")
    out = write_plan(plan(spec, memory="8GiB", seq_len=512), spec, tmp_path / "plan.yaml")
    r = _run("--from", str(out), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model"] == "openai-community/gpt2" and d["fits"] and "from the plan" in d["budget_source"]
    r = _run("--from", str(out), "--technique", "full", "--precision", "fp32", "--batch-size", "32", "--json")
    d = json.loads(r.output)
    assert not d["fits"] and d["setup"]["technique"] == "full" and d["setup"]["batch_size"] == 32
    assert r.exit_code == (0 if d["resolved"] else 1)


def test_setup_from_plan_drops_fields_a_new_technique_cannot_take():
    from memplan.planner.doctor import setup_from_plan
    doc = {"memplan": {"setup": Setup(technique="qlora", lora_targets="all-linear", precision="bf16").to_dict()}}
    s = setup_from_plan(doc, {"technique": "full"})
    assert (s.technique, s.quant, s.double_quant, s.lora_targets, s.precision) == ("full", None, False, None, "bf16")
    s = setup_from_plan(doc, {"batch_size": 2})
    assert s.technique == "qlora" and s.lora_targets == "all-linear" and s.batch_size == 2


def test_cli_nothing_fits_exit_1():
    r = _run("meta-llama/Llama-2-70b-hf", "--gpu", "RTX 3060", "--json")
    assert r.exit_code == 1 and json.loads(r.output)["resolved"] is False


def test_either_module_may_be_imported_first():
    import subprocess
    import sys
    code = "import memplan.cli.doctor as d, memplan.cli.main as c; assert d.doctor_command.name == 'doctor'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("args,needle", [
    (["gpt2", "--gpu", "T4", "--oom-message", "hello world"], "not a PyTorch out-of-memory message"),
    (["--gpu", "T4"], "name a MODEL"),
    (["gpt2", "--from", "/nonexistent/plan.yaml"], "cannot read plan file"),
    (["gpt2", "--gpu", "no-such-gpu-9000"], "unknown GPU"),
    (["gpt2", "--gpu", "T4", "--mode", "infer"], "training"),
])
def test_cli_bad_input_exit_2_without_traceback(args, needle):
    r = _run(*args)
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output
    assert isinstance(r.exception, SystemExit)


def test_cli_text_output_renders():
    r = _run("openai-community/gpt2", "--memory", "7.5GiB")
    assert r.exit_code == 0 and "remedies" in r.output and "gradient checkpointing" in r.output
    r2 = _run("openai-community/gpt2", "--memory", "80GiB", "--batch-size", "1")
    assert r2.exit_code == 0 and r2.output.startswith("Fits")


def test_setup_fields_in_remedies_stay_valid():
    spec = load_spec("meta-llama/Llama-3.2-1B")
    for s in (Setup(technique="lora", lora_targets="all-linear", lora_r=64), Setup(technique="freeze", trainable=2),
              Setup(technique="qlora", precision="bf16")):
        d = diagnose(spec, replace(s, batch_size=16, seq_len=1024), 6 * GiB)
        for r in d.remedies + d.combination:
            assert r.setup is None or isinstance(r.setup, Setup)


def test_doctor_from_a_plan_repeats_the_plans_need_and_spare(tmp_path):
    """Issue 42 item 8: plan said need 11.17 GiB, doctor --from the same plan 11.21 (doctor estimated without the
    card's cuBLAS workspace); and "spare" is what the budget leaves, the headroom excluded, in both."""
    import json
    from click.testing import CliRunner
    from memplan.cli.main import main
    runner = CliRunner()
    out = tmp_path / "plan.yaml"
    p = runner.invoke(main, ["plan", "meta-llama/Llama-2-7b-hf", "--gpu", "RTX 3060", "-o", str(out), "--json"])
    assert p.exit_code == 0, p.output
    plan = json.loads(p.output[p.output.index("{"):])
    d = runner.invoke(main, ["doctor", "--from", str(out), "--json"])
    diag = json.loads(d.output)
    assert diag["need_bytes"] == plan["estimate"]["need_bytes"]
    assert plan["spare_bytes"] == plan["budget_bytes"] - plan["estimate"]["need_bytes"] == diag["margin_bytes"]


def test_the_remedies_table_says_how_it_is_ordered_and_what_a_negative_saving_means():
    """Issue 42 item 8: "smallest change first" headed a table sorted by GiB saved when nothing fits, and a remedy
    that needs more memory showed as "saves -1.60 GiB"."""
    import dataclasses
    import io

    from rich.console import Console

    from memplan.cli.doctor import print_diagnosis
    from memplan.planner.doctor import diagnose
    from memplan.setup import Setup
    spec = load_spec("meta-llama/Llama-2-13b-hf")
    diag = diagnose(spec, Setup(technique="full", precision="bf16-mixed"), 12 * 2**30)
    out = io.StringIO()
    print_diagnosis(diag, Console(file=out, width=250))
    assert "remedies: no single change fits: largest saving first" in out.getvalue()
    worse = dataclasses.replace(diag.remedies[-1], saved_bytes=-int(1.6 * 2**30), fits=False)
    out = io.StringIO()
    print_diagnosis(dataclasses.replace(diag, remedies=(*diag.remedies[:-1], worse)), Console(file=out, width=250))
    assert "none: 1.60 more" in out.getvalue() and "-1.60" not in out.getvalue()
