"""The published-measurements benchmark accounts for every reference row (estimated, or skipped with a reason)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT.parent / "shared" / "reference" / "published_peaks_visible.csv"


def _published():
    spec = importlib.util.spec_from_file_location("published", ROOT / "benchmarks" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not CSV.exists(), reason="../shared/reference is not beside this checkout")
def test_every_row_is_estimated_or_explained():
    done, skipped, _ = _published().evaluate(CSV)
    ids = set(pd.read_csv(CSV)["source_id"])
    assert {r["id"] for r in done} | {r["id"] for r in skipped} == ids
    assert all(r["reason"] for r in skipped)
    assert len(done) >= 10
    # Mistral-7B full fine-tune, bf16 AdamW, checkpointing (fms-acceleration, A100-80GB, high trust): the optimizer
    # step sets the peak; the estimate must stay within 3% of the 67.46 GiB measured.
    f02 = next(r for r in done if r["id"] == "F02")
    assert abs(f02["rel_error"]) < 0.03 and f02["peak_phase"] == "optimizer_step"


def _accuracy():
    spec = importlib.util.spec_from_file_location("accuracy", ROOT / "benchmarks" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_accuracy_table_counts_every_ok_gpu_row_and_summarises_each_group(tmp_path):
    from memplan.measure.rows import measured_files, read_rows
    acc = _accuracy()
    data = ROOT / "data" / "measured"
    rows = acc.measured_errors(data)
    ok = [r for p in measured_files([str(data)]) for r in read_rows(p)
          if r.get("device", "cuda") == "cuda" and r.get("status") == "ok"]
    assert len(rows) == len(ok) >= 100
    summary = acc.table(rows)
    assert summary[-1]["group"] == "all" and summary[-1]["rows"] == len(rows)
    assert sum(s["rows"] for s in summary[:-1]) == len(rows)
    assert acc.main(["--out", str(tmp_path)]) == 0 and "| **all** |" in (tmp_path / "accuracy.md").read_text()


def test_family_survey_shapes_every_family_small_and_traces_one(tmp_path):
    spec = importlib.util.spec_from_file_location("family_survey", ROOT / "benchmarks" / "family_survey.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    d = mod.shape_config("qwen3_moe")
    assert d["hidden_size"] == 512 and d["num_local_experts"] == 4 and d.get("eos_token_id") in (None, 2)
    cells, failures = mod.survey("llama", tmp_path)
    assert not failures and all(abs(float(c.rstrip("%"))) < 1 for c in cells), (cells, failures)


def test_planner_check_verdict_reads_every_measured_batch():
    spec = importlib.util.spec_from_file_location("planner_check", ROOT / "benchmarks" / "planner_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # data/measured/planner-check.csv (H200, 2026-11-26): gpt2 on an RTX 3060 fitted 5 and 6, not 7
    gpt2 = {5: "ok", 6: "ok", 7: "oom"}
    assert mod.verdict(6, gpt2) == ("6", ">= 100%", True)
    assert mod.verdict(5, gpt2) == ("6", ">= 83%", False)  # the closed form's plan: below 90%
    assert mod.verdict(11, {11: "ok", 12: "ok", 13: "oom"}) == ("12", ">= 92%", True)  # Mistral-7B on an A100 40GB
    assert mod.verdict(21, {21: "ok", 22: "ok", 24: "ok"}) == (">= 24", "", False)  # no OOM above: not decided
    assert mod.verdict(8, {8: "oom"}) == ("", "planned OOMed", False)
    assert mod.verdict(27, {21: "ok", 24: "ok"}) == ("", "", False)  # the plan's batch not measured
    assert mod.verdict(20, {20: "ok", 25: "oom"}) == ("< 25", ">= 83%", False)  # 21-24 unmeasured: a lower bound
    # GRPO in whole groups of 4 (runnable_below): 12 OOMs, so 8 is the largest that can run at all
    groups = lambda n: (n - 1) // 4 * 4  # noqa: E731
    assert mod.verdict(8, {8: "ok", 12: "oom"}, groups) == ("8", ">= 100%", True)
    assert mod.verdict(8, {8: "ok", 12: "ok", 16: "oom"}, groups) == ("12", ">= 67%", False)
    # issue 43 item 8: a run under another transformers release than the device image's keeps its own rows and
    # report, since the planned batches move with the release
    assert mod.out_file(mod.IMAGE_RELEASE) == mod.OUT and mod.report_file(mod.IMAGE_RELEASE) == mod.REPORT
    assert mod.out_file("5.24.0").name == "planner-check-t5.24.0.csv"
    assert mod.report_file("5.24.0").name == "planner_check-t5.24.0.md"


def test_accuracy_replay_tier_and_requested_bytes():
    acc = _accuracy()
    # the offloading rows of gpu-h200-offload-loop.csv (informational) entered TRL's manager around all steps, a
    # harness the replay does not model (it runs TRL's per training_step); every other row is replayed
    rows = [r for r in acc.measured_errors(ROOT / "data" / "measured") if r["file"] != "gpu-h200-offload-loop.csv"]
    rep = [r for r in rows if r["replay_allocated"] is not None]
    # GRPO rows wait for a replay: the cut-model synthesis does not take GRPO's generation steps yet, and a
    # whole-model trace with generate() takes minutes per row on 2 cores (3 of the H200's GRPO rows replayed so
    # far, within 0.2% of the GPU's allocated peak; allocator_replay.py run --skip-trainer grpo for the rest)
    waiting = [r for r in rows if r["replay_status"] is None]
    assert all(r["trainer"] == "grpo" for r in waiting)
    assert sum(r["trainer"] == "grpo" for r in rep) >= 3
    # two capped planner runs fitted on the GPU where the replay ran out of memory under the same cap (docs/PLANNER.md
    # "Budget": QLoRA Qwen2.5-1.5B b4 after one release of the GPU's cache; DPO full Llama-3.2-1B b28), the
    # allocator traces of the next GPU session are to say why; every other ok row fitted in its replay too
    diverged = sorted((r["model"], r["label"]) for r in rows if r["replay_status"] == "oom")
    assert diverged == [
        ("Qwen/Qwen2.5-1.5B", "train qlora r16 all-linear bf16 nf4 adamw-fused b4 s1024 ckpt sdpa padded"),
        ("meta-llama/Llama-3.2-1B", "train dpo full bf16 adamw-fused b28 s1024 ckpt sdpa padded")]
    assert len(rep) >= 440
    # benchmarks/results/allocator_replay.csv against the H100/H200 rows: the replay's allocated peak (whole blocks)
    # within 0.0% median, worst -0.5% / +0.6%, training and inference rows alike, held to 1% (t5-base inference under
    # 5.17's math kernel was -4.6% before the stand-in kept aten's upcast q and _safe_softmax's mask: emulate_sdpa)
    assert max(abs(r["replay_allocated"]) for r in rep) <= 0.01
    t5 = next(r for r in rep if r["model"] == "google-t5/t5-base" and r["label"] == "infer full bf16 b8 s512")
    assert abs(t5["replay_allocated"]) < 0.001
    # t5-base eager bf16-mixed b16 s128 (data/measured/gpu-h100.csv): the closed form's -3.0% is the 2.8% of blocks
    # the allocator handed out unsplit (its tensors are within 0.5%)
    t5 = next(r for r in rep if r["model"] == "google-t5/t5-base" and r["label"].endswith("b16 s128 eager"))
    assert t5["allocated"] < -0.025 and t5["unsplit"] > 0.025 and abs(t5["allocated"] + t5["unsplit"]) < 0.005
    # rows that measured requested_bytes get their own lines
    text = "\n".join(acc.requested_section([{"requested": -0.01, "measured_unsplit": 0.02},
                                            {"requested": 0.004, "measured_unsplit": 0.0}]))
    assert "| closed form vs requested | 2 | 0.7% | 1.0% | -1.0% | 0.4% |" in text
    assert "median 1.0%, largest 2.0%" in text
    assert acc.requested_section([{"requested": None}]) == []
