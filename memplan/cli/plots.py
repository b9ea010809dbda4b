"""Pictures: the per-phase breakdown of one estimate (`memplan estimate --plot`) and memory against one knob
(`memplan plot --x batch_size|seq_len|lora_r`). matplotlib (Agg, imported lazily), GiB on the axes, atomic writes.
The `memplan plot` command: memplan.cli.plot.
"""
from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from memplan.planner.budget import DEFAULT_HEADROOM, budget_bytes, fits, need_bytes
from memplan.errors import BadInput
from memplan.fileio import write_bytes_atomic
from memplan.planner.fit_table import largest_fitting
from memplan.units import GiB
from memplan.estimator.breakdown import COMPONENTS, estimate
from memplan.estimator.memory.context import resolve
from memplan.estimator.phases import inference_phases, training_phases
from memplan.estimator import breakdown

KNOBS = ("batch_size", "seq_len", "lora_r")
FORMATS = (".png", ".svg", ".pdf")
DEVICE_ONLY = ("allocator_reserve", "paged_optimizer_state", "cuda_context")  # estimate._DEVICE_ONLY
_AXIS = {"batch_size": "micro-batch size", "seq_len": "sequence length", "lora_r": "LoRA rank r"}
_SHORT = {"batch_size": "batch {}", "seq_len": "seq_len {}", "lora_r": "r={}"}
_CAPS = {"batch_size": 4096, "seq_len": 131072}
#: one colour per component, the same in every picture: weights blue, training state green/orange,
#: per-token tensors warm, device-only terms grey (and hatched: not in torch.cuda.memory_allocated).
COLOURS = {
    "weights": "#4c72b0", "quant_state": "#9bb7e0", "lora_adapters": "#17becf", "gradients": "#dd8452",
    "optimizer_state": "#55a868", "optimizer_temporaries": "#a6d96a", "activations": "#c44e52",
    "autocast_weight_copies": "#f2a7a9", "logits": "#8172b3", "attention_mask": "#c5b0d5",
    "dequant_temporaries": "#ffbe7d", "dora_temporaries": "#fdd0a2", "backward_temporaries": "#937860", "forward_temporaries": "#a6761d",
    "kv_cache": "#da8bc3",
    "forward_kv_cache": "#e7a9d5",
    "cublas_workspace": "#ccb974", "allocator_reserve": "#c7c7c7", "paged_optimizer_state": "#a0a0a0",
    "cuda_context": "#6b6b6b",
}


def phase_breakdown(spec, setup) -> dict[str, dict[str, int]]:
    """Phase -> component -> bytes (COMPONENTS order): the estimator's phases plus the device-only terms the
    Estimate reports at its peak (reserve, paged optimizer state, CUDA context). The allocated components of a
    phase sum to Estimate.phases[phase]; the peak phase's bar sums to Estimate.device_total_bytes."""

    ctx = resolve(spec, setup)
    phases = training_phases(ctx) if setup.mode == "train" else inference_phases(ctx)
    device = {k: v for k, v in estimate(spec, setup).components.items() if k in DEVICE_ONLY}
    return {phase: {k: int({**parts, **device}.get(k, 0)) for k in COMPONENTS} for phase, parts in phases.items()}


def describe(setup, skip: str | None = None) -> str:
    """Short one-line setup, e.g. 'train · lora r=8 · bf16 · batch 4 × seq 1024 · grad ckpt' (`skip` one knob)."""
    s = setup
    tech = s.technique + (f" r={s.lora_r}" if s.uses_lora and skip != "lora_r" else "")
    parts = [s.mode, tech if s.mode == "train" else "", s.precision + (f" + {s.quant}" if s.quant else "")]
    shape = [f"batch {s.batch_size}" if skip != "batch_size" else "", f"seq {s.seq_len}" if skip != "seq_len" else ""]
    parts += [" × ".join(p for p in shape if p), "grad ckpt" if s.grad_ckpt and s.mode == "train" else ""]
    return " · ".join(p for p in parts if p)


def _figure(size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def card_name(gpu) -> str:
    return "memory budget" if gpu.source == "--memory" else gpu.name


def _card_line(ax, gpu, right: bool = True) -> None:
    ax.axhline(gpu.memory_bytes / GiB, color="black", linestyle="--", linewidth=1.3, zorder=3)
    ax.annotate(f"{card_name(gpu)}: {gpu.memory_bytes / GiB:.1f} GiB", (int(right), gpu.memory_bytes / GiB),
                xycoords=("axes fraction", "data"), xytext=(-4 if right else 4, 4), textcoords="offset points",
                ha="right" if right else "left", va="bottom", fontsize=9, fontweight="bold")


def breakdown_figure(est, phases: dict[str, dict[str, int]], gpu=None):
    """One stacked bar per phase (GiB), a stable colour per component, the total on each bar, the peak phase
    marked, and the card's memory as a dashed line when `gpu` is given."""
    fig = _figure((10, 5.6))
    ax = fig.add_subplot()
    names = list(phases)
    used = [c for c in COLOURS if any(p.get(c, 0) for p in phases.values())]
    bottoms = [0.0] * len(names)
    for comp in used:
        heights = [phases[p].get(comp, 0) / GiB for p in names]
        at_peak = phases[est.peak_phase].get(comp, 0)
        label = f"{comp.replace('_', ' ')}  " + (f"{at_peak / GiB:.2f}" if at_peak else "-")
        ax.bar(range(len(names)), heights, 0.62, bottom=bottoms, color=COLOURS[comp], edgecolor="white",
               linewidth=0.6, hatch="///" if comp in DEVICE_ONLY else None, label=label, zorder=2)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, (name, top) in enumerate(zip(names, bottoms)):
        peak = name == est.peak_phase
        ax.annotate(f"{top:.2f}" + ("\npeak" if peak else ""), (i, top), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9, fontweight="bold" if peak else "normal")
    top = max(bottoms + [gpu.memory_bytes / GiB if gpu else 0])
    ax.set_ylim(0, top * 1.15)
    if gpu:
        _card_line(ax, gpu)
    ax.set_xticks(range(len(names)), ["\n".join(n.rsplit("_", 1)) for n in names])
    ax.set_ylabel("GiB")
    ax.set_xlabel("phase (hatched: device-only terms, not allocated tensors)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.set_title(f"{est.model}\n{describe(est.setup)}", loc="left", fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False,
              title=f"GiB at the peak ({est.peak_phase})", title_fontsize=9, alignment="left")
    return fig


def _check_knob(knob: str, setup) -> None:
    if knob not in KNOBS:
        raise BadInput(f"cannot plot against {knob!r}; choose one of {', '.join(KNOBS)}")
    if knob == "lora_r" and not setup.uses_lora:
        raise BadInput(f"--x lora_r varies the LoRA rank, but this setup is {setup.mode} / {setup.technique}: "
                       "pass --technique lora (or qlora)")
    if knob == "seq_len" and setup.mode == "infer" and setup.prompt_len is not None:
        raise BadInput("--x seq_len varies the prompt length, but --prompt-len pins it: drop --prompt-len")


def default_values(knob: str, spec, setup) -> list[int]:
    """Doubling values: batch 1..256, seq_len 128..the model's max positions (itself included), lora_r 4..512."""
    _check_knob(knob, setup)
    if knob == "batch_size":
        return [2**i for i in range(9)]
    if knob == "lora_r":
        return [2**i for i in range(2, 10)]
    top = spec.arch.max_positions or 8192
    values = [v for v in (2**i for i in range(7, 18)) if v <= top]
    return values if top in values else values + [top]  # a non-power-of-two maximum is plotted too


def _estimator(estimator):
    return estimator or breakdown.estimate


def sweep(spec, setup, knob: str, values: Sequence[int], estimator: Callable | None = None) -> list[tuple]:
    """[(value, Estimate or None)] with `knob` set to each value; None where that value makes the setup invalid
    (e.g. a sequence beyond the model's positions)."""
    _check_knob(knob, setup)
    run = _estimator(estimator)
    out = []
    for v in values:
        try:
            out.append((v, run(spec, dataclasses.replace(setup, **{knob: v}))))
        except BadInput:
            out.append((v, None))
    return out


def trim(points: Sequence[tuple], budget_bytes: int, beyond: int = 2) -> list[tuple]:
    """The points up to the `beyond`-th valid one over the budget: keeps the y axis on the region near the card."""
    out, over = [], 0
    for v, e in points:
        if over >= beyond:
            break
        out.append((v, e))
        over += e is not None and not fits(e, budget_bytes)
    return out


def largest_fitting_value(spec, setup, knob: str, budget_bytes: int, estimator: Callable | None = None) -> int:
    """Largest integer value of `knob` whose need (memplan.planner.budget) fits `budget_bytes` (0 if 1 does not), by
    fit.largest_fitting. Caps: batch 4096, seq_len the model's max positions, lora_r the hidden size."""
    _check_knob(knob, setup)
    run = _estimator(estimator)
    cap = spec.arch.hidden_size if knob == "lora_r" else _CAPS[knob]
    if knob == "seq_len" and spec.arch.max_positions:
        cap = spec.arch.max_positions

    def fits_at(v: int) -> bool:
        try:
            return fits(run(spec, dataclasses.replace(setup, **{knob: v})), budget_bytes)
        except BadInput:
            return False

    return largest_fitting(fits_at, cap)


def curve_figure(points: Sequence[tuple], knob: str, gpu=None, largest: int | None = None,
                 headroom: float = DEFAULT_HEADROOM):
    """Peak allocated, peak reserved, device total and the need the fit test uses (GiB) against `knob` (log2 axis
    when the values span 3+ doublings); with `gpu`: the card's memory and its budget (memplan.planner.budget, `headroom`
    spare), the range that fits shaded and the largest fitting value marked (`largest`, exact from
    largest_fitting_value; else the largest plotted value that fits)."""
    valid = [(v, e) for v, e in points if e is not None]
    if not valid:
        raise BadInput(f"no value of {knob} gives a valid setup; nothing to plot")
    xs = [v for v, _ in valid]
    fig = _figure((9, 5.4))
    ax = fig.add_subplot()
    for attr, label, colour in (("peak_allocated_bytes", "peak allocated", "#4c72b0"),
                                ("peak_reserved_bytes", "peak reserved", "#dd8452"),
                                ("device_total_bytes", "device total (nvidia-smi)", "#c44e52"),
                                ("cap_need_bytes", "needs (fit test)", "#8172b3")):
        ax.plot(xs, [getattr(e, attr) / GiB for _, e in valid], marker="o", markersize=4, label=label,
                color=colour, linewidth=2 if attr == "cap_need_bytes" else 1.4, zorder=3)
    log2 = len(xs) > 2 and xs[-1] >= 8 * xs[0]  # spans 3+ doublings: a log2 axis
    if log2:
        ax.set_xscale("log", base=2)
    ticks = xs if len(xs) <= 12 else [2**i for i in range(20) if xs[0] <= 2**i <= xs[-1]] if log2 else None
    if ticks:
        ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.minorticks_off()
    lo, hi = xs[0], max(xs[-1], largest or 0)
    pad = 2 ** 0.25 if log2 else max((hi - lo) * 0.03, 0.5)
    ax.set_xlim(lo / pad if log2 else lo - pad, hi * pad if log2 else hi + pad)
    top = max(max(e.device_total_bytes, need_bytes(e)) for _, e in valid) / GiB
    if gpu:
        budget = budget_bytes(gpu.memory_bytes, headroom)
        limit = budget / GiB
        ax.set_ylim(0, max(top, gpu.memory_bytes / GiB) * 1.12)
        _card_line(ax, gpu, right=False)
        ax.axhline(limit, color="#2d7a3e", linestyle="--", linewidth=1.1, zorder=3,
                   label=f"budget: {headroom:.1%} headroom")
        exact = largest is not None
        if not exact:
            largest = max((v for v, e in valid if fits(e, budget)), default=0)
        left = ax.get_xlim()[0]
        if largest:
            ax.axvspan(left, largest, color="#55a868", alpha=0.13, zorder=0,
                       label=f"fits: needs ≤ {limit:.1f} GiB")
            ax.axvline(largest, color="#2d7a3e", linestyle=":", linewidth=1.5, zorder=2)
            text = "largest that fits: " + _SHORT[knob].format(largest)
            x0, x1 = ax.get_xlim()
            frac = math.log(largest / x0, x1 / x0) if log2 else (largest - x0) / (x1 - x0)
            left_of = frac > 0.4  # the text beside the line, on the side with room
            ax.annotate(text, (largest, 0.97), xycoords=("data", "axes fraction"), xytext=(-6 if left_of else 6, 0),
                        textcoords="offset points", ha="right" if left_of else "left", va="top",
                        fontsize=10, fontweight="bold", color="#2d7a3e",
                        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#2d7a3e", "alpha": 0.9})
        else:
            what = f"even {_SHORT[knob].format(1)}" if exact else _SHORT[knob].format(xs[0])
            ax.text(0.02, 0.95, f"{what} does not fit: over {limit:.1f} GiB", transform=ax.transAxes,
                    color="#c44e52", fontweight="bold", va="top")
    else:
        ax.set_ylim(0, top * 1.12)
    model = valid[0][1].model
    ax.set_title(f"{model}: memory vs {_AXIS[knob]}\n{describe(valid[0][1].setup, skip=knob)}", loc="left",
                 fontsize=11)
    notes = ["tokens" if knob == "seq_len" else "", "log2 scale" if log2 else ""]
    ax.set_xlabel(_AXIS[knob] + (f" ({', '.join(n for n in notes if n)})" if any(notes) else ""))
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3, zorder=0)
    ax.legend(loc="lower right", fontsize=9, framealpha=0.95)
    return fig


def save_figure(fig, path) -> Path:
    """Render `fig` (PNG at 120 dpi, or SVG/PDF by the extension) and write it atomically; returns the path."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in FORMATS:
        raise BadInput(f"cannot write a picture to {str(path)!r}: the name must end in {', '.join(FORMATS)}")
    buf = io.BytesIO()
    fig.savefig(buf, format=ext[1:], dpi=120, facecolor="white")
    try:
        write_bytes_atomic(path, buf.getvalue())
    except OSError as e:
        raise BadInput(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return path


def write_breakdown_png(spec, setup, est, path, gpu=None) -> Path:
    """`memplan estimate --plot PATH`: the per-phase breakdown of `est` (of spec, setup) against `gpu`."""
    return save_figure(breakdown_figure(est, phase_breakdown(spec, setup), gpu), path)
