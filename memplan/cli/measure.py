"""`memplan validate` and `memplan check`: measure setups for real, and gate CI on the stored measurements."""
from __future__ import annotations

import sys

import click

from memplan.cli.options import (emit_json, format_options, given_setup_fields, handle_errors, load_model,
                                 parse_fraction, setup_options)
from memplan.errors import BadInput
from memplan.cli.report import output_console, validation_rows, print_validation, print_check
from memplan.estimator.breakdown import estimate
from memplan.fileio import check_writable, write_text_atomic
from memplan.measure.gate import check, markdown
from memplan.measure.rows import append_row, make_row
from memplan.measure.runner import require_cuda, validate
from memplan.measure.sweep import already_done, now_iso, load_sweep, run_sweep
from memplan.setup import Setup


@click.command("validate")
@click.argument("model", required=False)
@setup_options
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: the same steps on the CPU, allocated bytes through the tracer's accounting")
@click.option("--steps", type=click.IntRange(min=2, max=100), default=3, show_default=True,
              help="optimizer steps to run")
@click.option("--memory-fraction", help="cap the allocator to this fraction of the GPU (0.15 or 15%)")
@click.option("--emulate", help='cap the allocator to a smaller card\'s memory, e.g. "RTX 3060" (less the context)')
@click.option("--sweep", "sweep_file", type=click.Path(dir_okay=False), help="run every setup of a sweep YAML file")
@click.option("--out", type=click.Path(dir_okay=False), help="append each measured row to this CSV (resumable)")
@click.option("--timeout", type=click.FloatRange(min=1), help="seconds allowed per setup")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@handle_errors
def validate_cmd(model, device, steps, memory_fraction, emulate, sweep_file, out, timeout, as_json, **options):
    """Run MODEL's setup for real (random weights, real transformers/peft/bitsandbytes, 3 training steps) in a
    subprocess and compare the measured peaks with the estimate; or run a --sweep into a --out CSV."""
    if memory_fraction and emulate:
        raise BadInput("pass either --memory-fraction or --emulate, not both")
    if device == "cuda":
        require_cuda()
    if sweep_file:
        if model or given_setup_fields(options):
            raise BadInput("--sweep takes its models and setups from the file: drop MODEL and the setup flags")
        if not out:
            raise BadInput("--sweep needs --out data/measured/<gpu>.csv (rows are appended there, resumably)")
        return _run_sweep(sweep_file, out, device, steps, timeout)
    if not model:
        raise BadInput("name a MODEL (catalog id or config.json), or pass --sweep sweep.yaml --out rows.csv")
    fraction = parse_fraction(memory_fraction, "--memory-fraction") if memory_fraction is not None else None
    _validate_one(model, device, steps, fraction, emulate, out, timeout, as_json, options)


def _validate_one(model, device, steps, fraction, emulate, out, timeout, as_json, options):
    setup = Setup(**given_setup_fields(options))
    spec = load_model(model)
    est = estimate(spec, setup)  # setup problems surface before a GPU is touched
    if out:
        check_writable(out)  # before the run, whose result would be lost
    m = validate(model, setup, device=device, steps=steps, memory_fraction=fraction, emulate=emulate,
                 timeout=timeout)
    if out:
        append_row(out, make_row(model, setup, source="memplan validate", measured_at=now_iso(),
                                 notes=f"emulating {emulate}" if emulate else "", **m.row_values()))
    rows = validation_rows(m, est)
    if as_json:
        emit_json({"model": spec.model_id, "setup": setup.to_dict(), "status": m.status,
                   "measured": {r["key"]: r["measured_bytes"] for r in rows},
                   "predicted": {r["key"]: r["predicted_bytes"] for r in rows},
                   "comparison": rows, "row": m.row_values()})
    else:
        print_validation(spec.model_id, setup, m, rows)
    sys.exit(0 if m.status == "ok" else 1)


def _run_sweep(sweep_file, out, device, steps, timeout):
    from rich.progress import Progress

    jobs, skipped, file_steps = load_sweep(sweep_file)
    check_writable(out)
    for s in skipped:
        click.echo(f"skipped (invalid combination): {s}", err=True)
    with Progress(transient=False) as progress:
        # a resumed sweep starts where it stopped: its bar ends at 100% (it ended at 25% or 75%: issue 42)
        task = progress.add_task(f"validate -> {out}", total=len(jobs), completed=already_done(jobs, out, device))

        def done(job, m):
            progress.advance(task)
            progress.console.print(f"{m.status:5} {job.model} {job.setup.technique} b{job.setup.batch_size} "
                                   f"s{job.setup.seq_len}" + (f" ({m.error[:80]})" if m.error else ""))
        try:
            counts = run_sweep(jobs, out, device=device, steps=steps if steps != 3 else file_steps,
                               on_done=done, timeout=timeout)
        except KeyboardInterrupt:
            click.echo(f"interrupted: the rows written so far are in {out}; run the same command to resume",
                       err=True)
            sys.exit(130)
    click.echo(f"{counts['run']} run ({counts['ok']} ok, {counts['oom']} oom, {counts['error']} error), "
               f"{counts['already_done']} already in {out}, {len(skipped)} invalid combinations skipped")
    if counts["error"]:
        click.echo(f"{counts['error']} run(s) failed (status error in {out}): run the same command to retry them",
                   err=True)
        sys.exit(1)


@click.command("check")
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--tolerance", default="5%", show_default=True,
              help="allowed |relative error| for rows without their own tolerance column")
@click.option("--measure", type=click.Choice(["allocated", "reserved", "device"]), default="allocated",
              show_default=True, help="quantity compared where a row has it (else the row's first measured one)")
@click.option("--report", "report_path", default="memplan-check.md", show_default=True,
              type=click.Path(dir_okay=False), help="markdown report written here")
@format_options
@handle_errors
def check_cmd(paths, tolerance, measure, report_path, fmt):
    """Re-estimate every stored measurement (default data/measured/) with the current estimator; exit 1 when a
    row is outside the tolerance or a measured OOM is predicted to fit."""

    tol = parse_fraction(tolerance, "--tolerance")
    check_writable(report_path, "--report")
    result = check(paths or ("data/measured",), tolerance=tol, measure=measure)
    write_text_atomic(report_path, markdown(result))
    if fmt == "json":
        emit_json({"ok": result.ok, "tolerance": tol, "report": report_path,
                   "rows": [dict(verdict=r.verdict, model=r.model, setup=r.label, quantity=r.quantity,
                                 measured_bytes=r.measured_bytes, predicted_bytes=r.predicted_bytes,
                                 rel_error=r.rel_error, tolerance=r.tolerance, reason=r.reason, file=r.file)
                            for r in result.worst_first()]})
    else:
        print_check(result, report_path, output_console(fmt))
    sys.exit(0 if result.ok else 1)
