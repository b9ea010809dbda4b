"""memplan.cli.plots: phase breakdown sums, exact largest-fitting value, real atomic PNGs, clean errors, the plot command."""
from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from memplan.cli import plots
from memplan.cli.plot import plot_command
from memplan.planner.budget import budget_bytes
from memplan.errors import BadInput
from memplan.estimator.breakdown import estimate
from memplan.planner.fit_table import largest_fitting, max_batch_size
from memplan.gpus import find_gpu, resolve_gpu
from memplan.model.catalog import load_spec
from memplan.setup import Setup

PNG = b"\x89PNG\r\n\x1a\n"
LORA = Setup(technique="lora", precision="bf16", batch_size=2, seq_len=256)


@pytest.fixture(scope="module")
def gpt2():
    return load_spec("gpt2")


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setattr("memplan.gpus.detect_gpus", lambda: [])  # the same answer on a machine with a GPU
    group = click.Group()
    group.add_command(plot_command)
    return lambda *args: CliRunner().invoke(group, ["plot", *args])


def _annotations(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


@pytest.mark.parametrize("setup", [
    LORA, Setup(), Setup(technique="qlora", optimizer="paged-adamw-8bit", precision="bf16", grad_ckpt=True),
    Setup(mode="infer", precision="bf16", batch_size=4, seq_len=256),
], ids=["lora", "full", "qlora-paged", "infer"])
def test_phase_breakdown_sums_to_the_estimate(gpt2, setup):
    est = estimate(gpt2, setup)
    phases = plots.phase_breakdown(gpt2, setup)
    assert list(phases) == list(est.phases)
    device = {k: v for k, v in est.components.items() if k in plots.DEVICE_ONLY}
    for name, parts in phases.items():
        assert list(parts) == list(est.components)  # COMPONENTS order, every phase
        assert sum(v for k, v in parts.items() if k not in plots.DEVICE_ONLY) == est.phases[name]
        assert {k: parts[k] for k in plots.DEVICE_ONLY} == device
    assert sum(phases[est.peak_phase].values()) == est.device_total_bytes
    assert phases[est.peak_phase] == est.components


def test_default_values(gpt2):
    assert plots.default_values("batch_size", gpt2, LORA) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert plots.default_values("seq_len", gpt2, LORA) == [128, 256, 512, 1024]  # gpt2: 1024 positions
    assert plots.default_values("lora_r", gpt2, LORA) == [4, 8, 16, 32, 64, 128, 256, 512]


def test_sweep_marks_invalid_values_none(gpt2):
    points = plots.sweep(gpt2, LORA, "seq_len", [512, 1024, 2048])
    assert [v for v, _ in points] == [512, 1024, 2048]
    assert points[0][1].setup.seq_len == 512 and points[1][1] is not None
    assert points[2][1] is None  # beyond gpt2's 1024 positions


def test_lora_r_needs_lora_cleanly(gpt2, cli):
    for call in (lambda: plots.default_values("lora_r", gpt2, Setup()),
                 lambda: plots.sweep(gpt2, Setup(), "lora_r", [8]),
                 lambda: plots.largest_fitting_value(gpt2, Setup(), "lora_r", 8 * 2**30)):
        with pytest.raises(BadInput, match="--technique lora"):
            call()
    r = cli("gpt2", "--x", "lora_r", "--memory", "8GiB", "-o", "x.png")
    assert r.exit_code == 2 and "--technique lora" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("knob", plots.KNOBS)
def test_largest_fitting_value_is_fit_largest_fitting(gpt2, knob):
    budget = int(3.5 * 2**30)
    value = plots.largest_fitting_value(gpt2, LORA, knob, budget)
    total = lambda v: estimate(gpt2, dataclasses.replace(LORA, **{knob: v})).cap_need_bytes  # noqa: E731
    cap = {"batch_size": 4096, "seq_len": 1024, "lora_r": gpt2.arch.hidden_size}[knob]
    assert value == largest_fitting(lambda v: total(v) <= budget, cap)
    if knob == "batch_size":
        assert value == max_batch_size(gpt2, LORA, budget, estimate)
    assert 1 <= value <= cap and total(value) <= budget
    if value < cap:
        assert total(value + 1) > budget  # exact: the next integer no longer fits


def test_curve_marks_the_exact_largest_value(gpt2):
    gpu = resolve_gpu(memory="4GiB")
    best = plots.largest_fitting_value(gpt2, LORA, "batch_size", budget_bytes(gpu.memory_bytes))
    points = plots.sweep(gpt2, LORA, "batch_size", plots.default_values("batch_size", gpt2, LORA))
    assert best not in [v for v, _ in points]  # between two plotted points: only the exact search finds it
    fig = plots.curve_figure(points, "batch_size", gpu, best)
    ax = fig.axes[0]
    assert f"largest that fits: batch {best}" in _annotations(fig)
    assert [line.get_label() for line in ax.get_lines()][:4] == ["peak allocated", "peak reserved",
                                                                 "device total (nvidia-smi)", "needs (fit test)"]
    assert ax.get_ylabel() == "GiB" and ax.get_xscale() == "log"
    nothing = plots.curve_figure(points, "batch_size", resolve_gpu(memory="100MiB"), 0)
    assert any("does not fit" in t for t in _annotations(nothing))


def test_breakdown_figure_and_png(gpt2, tmp_path):
    est = estimate(gpt2, LORA)
    fig = plots.breakdown_figure(est, plots.phase_breakdown(gpt2, LORA), find_gpu("RTX 3060"))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("weights ") for t in legend) and any(t.startswith("cuda context ") for t in legend)
    assert any("RTX 3060" in t for t in _annotations(fig))
    path = plots.write_breakdown_png(gpt2, LORA, est, tmp_path / "sub" / "breakdown.png", find_gpu("RTX 3060"))
    assert path.read_bytes().startswith(PNG)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["breakdown.png"]  # atomic: no temp file left


def test_save_figure_formats_and_bad_extension(gpt2, tmp_path):
    fig = plots.breakdown_figure(estimate(gpt2, LORA), plots.phase_breakdown(gpt2, LORA))
    assert plots.save_figure(fig, tmp_path / "b.svg").read_text().lstrip().startswith("<?xml")
    assert plots.save_figure(fig, tmp_path / "b.PDF").read_bytes().startswith(b"%PDF")
    with pytest.raises(BadInput, match=r"\.png, \.svg, \.pdf"):
        plots.save_figure(fig, tmp_path / "b.jpg")
    (tmp_path / "b.png").write_bytes(b"old")
    plots.save_figure(fig, tmp_path / "b.png")  # replaces an existing file
    assert (tmp_path / "b.png").read_bytes().startswith(PNG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.PDF", "b.png", "b.svg"]


def test_plot_command_writes_png_and_prints_largest(gpt2, cli, tmp_path):
    out = tmp_path / "curve.png"
    r = cli("gpt2", "--technique", "lora", "--precision", "bf16", "--seq-len", "256", "--x", "batch_size",
            "--memory", "3GiB", "-o", str(out))
    assert r.exit_code == 0, r.output
    budget = budget_bytes(3 * 2**30)  # the 3.5% default headroom, as fit, plan and doctor
    best = plots.largest_fitting_value(gpt2, dataclasses.replace(LORA, seq_len=256), "batch_size", budget)
    expected = f"fits on memory budget (3.00 GiB, budget {budget / 2**30:.2f} GiB): {best}"
    assert str(out) in r.output and expected in r.output
    assert out.read_bytes().startswith(PNG) and [p.name for p in tmp_path.iterdir()] == ["curve.png"]


def test_plot_command_without_gpu_and_with_values(cli, tmp_path):
    out = tmp_path / "seq.png"
    r = cli("gpt2", "--x", "seq_len", "--values", "64,128,256", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "without a card limit" in r.output and out.read_bytes().startswith(PNG)


@pytest.mark.parametrize("args, message", [
    (["--x", "batch_size", "-o", "OUT.jpg"], "must end in .png"),
    (["--x", "batch_size", "--values", "1,two", "-o", "OUT.png"], "whole numbers"),
    (["--x", "batch_size", "--values", "0,4", "-o", "OUT.png"], ">= 1"),
    (["--x", "seq_len", "--values", "2048,4096", "-o", "OUT.png"], "max_position_embeddings"),
    (["--x", "batch_size", "--gpu", "no-such-card", "-o", "OUT.png"], "unknown GPU"),
    (["--x", "batch_size", "--batch-size", "0", "-o", "OUT.png"], "invalid setup"),
])
def test_plot_command_bad_input_is_clean(cli, tmp_path, args, message):
    args = [str(tmp_path / a) if a.startswith("OUT.") else a for a in args]
    r = cli("gpt2", *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []
