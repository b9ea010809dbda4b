"""`memplan plot`: memory against one knob, drawn by memplan.cli.plots (kept apart so the pictures module needs no
click and this command imports only memplan.cli.options)."""
from __future__ import annotations

import dataclasses

import click

from memplan.planner.budget import budget_bytes
from memplan.cli.options import handle_errors, headroom_option, load_model, setup_from_options, setup_options
from memplan.errors import BadInput
from memplan.cli.plots import (KNOBS, card_name, curve_figure, default_values, largest_fitting_value, save_figure, sweep,
                           trim)
from memplan.units import GiB
from memplan.estimator.breakdown import estimate
from memplan.gpus import detect_gpus, resolve_gpu


def _parse_values(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise BadInput(f"--values {text!r}: give whole numbers separated by commas, e.g. 1,2,4,8") from None
    if not values or values[0] < 1:
        raise BadInput(f"--values {text!r}: give whole numbers >= 1, e.g. 1,2,4,8")
    return values


@click.command("plot")
@click.argument("model")
@click.option("--x", "knob", type=click.Choice(KNOBS), required=True, help="the setup field on the x axis")
@click.option("--gpu", "gpu_name", help='GPU name, e.g. "RTX 3060"; default: the detected GPU, if any')
@click.option("--memory", help="memory budget instead of a GPU name, e.g. 12GiB")
@click.option("--values", help="comma-separated values of --x (default: doubling values)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="picture: .png/.svg/.pdf")
@headroom_option
@setup_options
@click.option("--trust-remote-code", is_flag=True)
@handle_errors
def plot_command(model, knob, gpu_name, memory, values, output, headroom, trust_remote_code, **options):
    """Peak allocated / reserved / device total and the need the fit test uses against batch_size, seq_len or
    lora_r, with the card's memory and budget, the range that fits shaded and the largest value that fits."""

    setup = setup_from_options(options)
    spec = load_model(model, trust_remote_code=trust_remote_code)
    xs = _parse_values(values) if values is not None else default_values(knob, spec, setup)
    given = gpu_name is not None or memory is not None  # an empty --gpu '' is refused, not ignored
    gpu = resolve_gpu(gpu_name, memory) if given else next(iter(detect_gpus()), None)
    points = sweep(spec, setup, knob, xs)
    budget = budget_bytes(gpu.memory_bytes, headroom) if gpu else None
    if gpu and not values:
        points = trim(points, budget)
    if all(e is None for _, e in points):  # re-run one to raise the estimator's own reason
        estimate(spec, dataclasses.replace(setup, **{knob: xs[0]}))
    best = largest_fitting_value(spec, setup, knob, budget) if gpu else None
    written = save_figure(curve_figure(points, knob, gpu, best, headroom), output)
    click.echo(f"wrote {written}")
    if gpu is None:
        click.echo("no GPU given (--gpu/--memory) or detected: drawn without a card limit")
    else:
        card = f"{card_name(gpu)} ({gpu.memory_bytes / GiB:.2f} GiB, budget {budget / GiB:.2f} GiB)"
        click.echo(f"largest {knob} that fits on {card}: {best}" if best
                   else f"even {knob}=1 does not fit on {card}")
