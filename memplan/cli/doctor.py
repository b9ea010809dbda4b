"""`memplan doctor`: the command and its printing; the diagnosis itself is memplan.planner.doctor."""
from __future__ import annotations

import json
import sys

import click

from memplan.cli.options import given_setup_fields, handle_errors, headroom_option, load_model, setup_options
from memplan.errors import BadInput
from memplan.estimator.breakdown import estimator_for
from memplan.planner.budget import DEFAULT_HEADROOM, budget_bytes, need_terms
from memplan.planner.doctor import Diagnosis, diagnose, setup_from_plan
from memplan.planner.oom import OomInfo, parse_oom_message
from memplan.setup import Setup
from memplan.units import GiB, fmt_gib
from memplan.cli.report import table
from memplan.gpus import find_gpu, refuse_empty_card, resolve_gpu
from memplan.planner.explain import describe


def print_diagnosis(diag: Diagnosis, console=None) -> None:
    """First line (the smallest fix), the ranked remedies, the combination and the notes, as rich tables."""
    from rich.console import Console

    console = console or Console()
    colour = "green" if diag.fits and not diag.barely_fits else ("yellow" if diag.resolved else "red")
    console.print(f"[bold {colour}]{diag.first_line}[/]", highlight=False)
    console.print(f"{diag.model} · {describe(diag.setup)} · seq {diag.setup.seq_len}: "
                  f"needs {fmt_gib(diag.need_bytes)} ({need_terms(diag.estimate)}) "
                  f"of the budget {fmt_gib(diag.budget_bytes)}"
                  + (f" ({diag.budget_source})" if diag.budget_source else ""), highlight=False)
    if diag.remedies:
        if diag.fits:
            order = "what buys margin, smallest change first"
        elif any(r.fits for r in diag.remedies):
            order = "those that fit first, smallest change first; then the rest, largest saving first"
        else:
            order = "no single change fits: largest saving first"
        t = table(f"remedies: {order} (size 1 knob ... 5 data)", ("#", "right"), "change · its cost",
                  ("size", "right"), ("saves GiB", "right"), ("new need GiB", "right"), ("fits", "center"))
        for n, r in enumerate(diag.remedies, 1):
            peak = "n/a" if r.need_bytes is None else f"{r.need_bytes / GiB:,.2f}"
            fits = "?" if r.fits is None else ("[green]yes[/]" if r.fits else "[red]no[/]")
            saves = (f"none: {-r.saved_bytes / GiB:,.2f} more" if r.saved_bytes < 0 else
                     f"{'up to ' if r.fits is None else ''}{r.saved_bytes / GiB:,.2f}")
            t.add_row(str(n), f"{r.description}\n[dim]{r.cost}[/]", str(r.size), saves, peak, fits)
        console.print(t)
    if diag.combination:
        t = table("combined (cumulative, in order of application)", "step · its cost", ("saves GiB", "right"),
                  ("needs GiB", "right"), ("fits", "center"))
        for r in diag.combination:
            t.add_row(f"{r.description}\n[dim]{r.cost}[/]", f"{r.saved_bytes / GiB:,.2f}",
                      f"{r.need_bytes / GiB:,.2f}", "[green]yes[/]" if r.fits else "[red]no[/]")
        console.print(t)
        console.print(f"combined setup: {describe(diag.combination[-1].setup)}", highlight=False)
    for note in diag.notes:
        console.print(f"note: {note}", highlight=False)


def _gpu_memory(gpu_name, memory, oom: OomInfo | None, doc: dict | None) -> tuple[int, str, bool, object]:
    """(GPU memory bytes, where it came from, bf16, the Gpu when one is named): --gpu/--memory, else the OOM
    message, else the plan's GPU."""
    refuse_empty_card(gpu_name, memory)
    if not (gpu_name or memory) and oom and oom.total_capacity_bytes:
        return oom.total_capacity_bytes, "total capacity in the OOM message", True, None
    if not (gpu_name or memory) and doc:
        m = doc.get("memplan") or {}
        try:
            g = find_gpu(str(m.get("gpu")))
            return g.memory_bytes, f"{g.name}, from the plan", g.bf16, g
        except BadInput:
            if m.get("gpu_memory_gib"):
                return int(float(m["gpu_memory_gib"]) * GiB), f"{m.get('gpu')}, from the plan", True, None
    g = resolve_gpu(gpu_name, memory)
    return g.memory_bytes, g.name, g.bf16, g


def run_doctor(model: str | None, gpu_name: str | None = None, memory: str | None = None, from_plan: str | None = None,
               oom_message: str | None = None, oom_file: str | None = None, given: dict | None = None,
               trust_remote_code: bool = False, headroom: float = DEFAULT_HEADROOM) -> Diagnosis:
    """The command's work: read the OOM text and the plan file, build the setup (plan fields, then `given` flags),
    pick the GPU memory and its budget (memplan.planner.budget), diagnose. Raises BadInput for anything the user must fix."""

    if oom_message and oom_file:
        raise BadInput("pass either --oom-message or --oom-file, not both")
    if oom_file:
        try:
            with open(oom_file, encoding="utf-8", errors="replace") as f:
                oom_message = f.read()
        except OSError as e:
            raise BadInput(f"cannot read {oom_file!r}: {e.strerror}") from None
    oom = parse_oom_message(oom_message) if oom_message is not None else None
    from memplan.planner.export import read_plan_document  # lazily: pydantic and yaml, for --from only

    doc = read_plan_document(from_plan) if from_plan else None
    setup = setup_from_plan(doc, given or {}) if doc else Setup(**(given or {}))
    model = model or (doc and (doc.get("model") or {}).get("id"))
    if not model:
        raise BadInput("name a MODEL (e.g. meta-llama/Llama-2-7b-hf) or a plan file with --from plan.yaml")
    gpu_bytes, source, bf16, gpu = _gpu_memory(gpu_name, memory, oom, doc)
    # estimated for the card's architecture, as plan and fit do (its cuBLAS workspace): the same need as the plan's
    return diagnose(load_model(model, trust_remote_code=trust_remote_code), setup, budget_bytes(gpu_bytes, headroom),
                    estimator_for(gpu), bf16=bf16, oom=oom,
                    budget_source=f"{source}: {fmt_gib(gpu_bytes)} less {headroom:.1%} headroom",
                    gpu_memory_bytes=gpu_bytes)


@click.command("doctor")
@click.argument("model", required=False)
@click.option("--gpu", "gpu_name", help='GPU name, e.g. "RTX 3060" (see `memplan gpus`)')
@click.option("--memory", help="memory budget instead of a GPU name, e.g. 12GiB")
@click.option("--from", "from_plan", type=click.Path(dir_okay=False),
              help="plan file (memplan plan -o): its model, setup and GPU; flags override them")
@click.option("--oom-message", help='a pasted "CUDA out of memory. Tried to allocate ..." error')
@click.option("--oom-file", type=click.Path(dir_okay=False), help="a file holding the OOM error output")
@headroom_option
@setup_options
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@handle_errors
def doctor_command(model, gpu_name, memory, from_plan, oom_message, oom_file, headroom, trust_remote_code, as_json,
                   **options):
    """Why a training setup does not fit (or barely fits) a GPU, and the smallest changes that make it fit.
    Exit 0: it fits or a change makes it fit; 1: nothing does; 2: bad input."""
    diag = run_doctor(model, gpu_name, memory, from_plan, oom_message, oom_file, given_setup_fields(options),
                      trust_remote_code, headroom)
    if as_json:
        click.echo(json.dumps(diag.to_dict(), indent=2))
    else:
        print_diagnosis(diag)
    sys.exit(diag.exit_code)
