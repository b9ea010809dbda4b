"""Rendering: the only user of rich (and, later, pandas/matplotlib). GiB = 2**30, labelled GiB."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from memplan.planner.budget import need_bytes, need_terms
from memplan.units import GiB, fmt_count
from memplan.planner.explain import describe
from memplan.setup import sharding_label


FORMATS = ("table", "markdown", "csv", "json")

#: width when the output is not a terminal (a pipe, a file, a notebook's captured output): wide enough that no
#: table of ours wraps, as rich's default of 80 columns did
PIPE_WIDTH = 250


def make_console(stderr: bool = False) -> Console:
    """A terminal's own width; full width (PIPE_WIDTH) when piped, unless COLUMNS says otherwise."""
    import os
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=PIPE_WIDTH)
    return console


def _plain(cell) -> str:
    """A cell or line as printed text: rich markup removed (text that is not valid markup stays as written)."""
    from rich.errors import MarkupError
    from rich.text import Text
    if isinstance(cell, Text):
        return cell.plain
    try:
        return Text.from_markup(str(cell)).plain
    except MarkupError:
        return str(cell)


def table_cells(t: Table) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of a rich Table as plain text (markup removed, folded cells joined)."""
    def plain(cell) -> str:
        return " ".join(_plain(cell).split())

    headers = [plain(c.header) for c in t.columns]
    rows = [list(r) for r in zip(*([plain(x) for x in c._cells] for c in t.columns))]
    return headers, rows


def table_frame(t: Table):
    """A rich Table as a pandas DataFrame of strings (the figures as printed)."""
    import pandas as pd
    headers, rows = table_cells(t)
    return pd.DataFrame(rows, columns=headers)


class FormatConsole:
    """Prints what the print_* functions hand it in one of FORMATS' text formats: a Table as a markdown table or
    as CSV (pandas), a line of text as a markdown paragraph or, for CSV, on stderr, so that stdout parses."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.out = make_console()
        self.err = make_console(stderr=True)

    def print(self, obj="", **kw) -> None:
        if isinstance(obj, Table):
            title = _plain(obj.title or "")
            frame = table_frame(obj)
            if self.fmt == "csv":
                if title:
                    self.out.print("# " + " ".join(title.split()), markup=False, highlight=False, soft_wrap=True)
                self.out.print(frame.to_csv(index=False), end="", markup=False, highlight=False, soft_wrap=True)
            else:
                cell = lambda v: str(v).replace("|", "\\|")
                lines = ([f"**{' '.join(title.split())}**", ""] if title else [])
                lines += ["| " + " | ".join(map(cell, frame.columns)) + " |",
                          "|" + "|".join("---" for _ in frame.columns) + "|"]
                lines += ["| " + " | ".join(map(cell, row)) + " |" for row in frame.itertuples(index=False)]
                self.out.print("\n".join(lines) + "\n", markup=False, highlight=False, soft_wrap=True)
            return
        text = _plain(obj) if isinstance(obj, str) and kw.get("markup", True) else str(obj)
        (self.err if self.fmt == "csv" else self.out).print(text, markup=False, highlight=False, soft_wrap=True)


def output_console(fmt: str = "table"):
    """The console the print_* functions write to for --format FMT (json is printed by the caller)."""
    return make_console() if fmt == "table" else FormatConsole(fmt)


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def table(title: str, *columns) -> Table:
    """A left-titled table; each column is a name (left-aligned) or (name, "right" | "center")."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        name, just = (col, "left") if isinstance(col, str) else col
        t.add_column(name, justify=just)
    return t


def _error_row(t: Table, option: str, error: str, width: int) -> None:
    """An option that does not apply to the model: n/a and the first line of why, in the last column (the first
    problem where the message lists them under a heading such as "setup does not suit gpt2:")."""
    lines = [line.strip(" -") for line in error.splitlines() if line.strip(" -")]
    why = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0] if lines else error
    t.add_row(option, "n/a", *["-"] * (width - 3), why[:80])


def tokens_label(s) -> str:
    """The tokens per sample as the setup gives them: a training sequence, or an inference prompt and the new tokens
    (issue 42 item 8: the header said "seq 512" when --prompt-len 2048 was given)."""
    if s.trainer == "grpo":
        return (f"(prompt {s.prompt_len or s.seq_len} + completion {s.max_completion_length}), {s.num_generations} "
                "generations per prompt")
    if s.trainer == "dpo":
        return f"(chosen + rejected) seq {s.seq_len}" + (f", prompt {s.prompt_len}" if s.prompt_len else "")
    if s.mode != "infer":
        return f"seq {s.seq_len}" + (" packed" if s.packing or s.padding_free else "")
    new = f" + {s.new_tokens} new" if s.new_tokens is not None else ""
    return f"prompt {s.prompt_len or s.seq_len}{new}"


def estimate_table(e) -> Table:
    """Components at the peak (GiB and % of the device total), then the three peaks and what the fit test needs."""
    s = e.setup
    trainer = f"TRL {s.trainer.upper()} · " if s.trainer != "hf" else ""
    what = (f"{trainer}{s.mode} · {s.technique} · {s.precision}" + (f" · {s.quant}" if s.quant else "")
            + f" · batch {s.batch_size} x {tokens_label(s)}" + (" · grad ckpt" if s.grad_ckpt else ""))
    if s.sharding != "none":
        what += f" · per GPU: {sharding_label(s)}"
    t = Table(title=f"{e.model}\n{what}", title_justify="left")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    t.add_column("% of device", justify="right")
    for name, value in e.components.items():
        if value:
            t.add_row(name.replace("_", " "), _gib(value), f"{100 * value / e.device_total_bytes:.1f}")
    t.add_section()
    t.add_row(f"peak allocated ({e.peak_phase})", _gib(e.peak_allocated_bytes), "")
    t.add_row("peak reserved", _gib(e.peak_reserved_bytes), "")
    t.add_row("device total (nvidia-smi)", _gib(e.device_total_bytes), "100.0", style="bold")
    t.add_row("needs on a full card (fit test: + largest tensor"
              + (" + split cache)" if e.cap_fragmentation_bytes else ")"), _gib(need_bytes(e)), "")
    if e.host_bytes:
        t.add_row("host RAM (pinned) per GPU / per node", f"{_gib(e.host_bytes)} / {_gib(e.host_bytes * s.num_gpus)}",
                  "")
    return t


def print_estimate(e, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(estimate_table(e))
    console.print(f"parameters: {e.params_total:,} total, {e.params_trainable:,} trainable; "
                  + "; ".join(e.notes))


def fit_table(result) -> Table:
    g = result.gpu
    t = table(f"{result.model} on {g.name} ({_gib(g.memory_bytes)} GiB; budget {_gib(result.budget_bytes)} GiB "
              f"with {result.headroom:.1%} headroom), seq_len {result.seq_len}, padded batches", "option",
              ("fits", "center"),
              ("max micro-batch", "right"), ("needs GiB at batch 1", "right"), ("missing", "right"))
    for r in result.rows:
        if r.error:
            _error_row(t, r.option, r.error, 5)
            continue
        t.add_row(r.option, "[green]yes[/]" if r.fits else "[red]no[/]", str(r.max_batch_size) if r.fits else "0",
                  _gib(r.need_bytes_at_batch_1), f"{_gib(r.shortfall_bytes)} GiB" if r.shortfall_bytes else "")
    return t


def scale_out_table(result) -> Table:
    g = result.gpu
    what = f"on {result.num_gpus} x {g.name}" if result.num_gpus else f"fewest {g.name} cards"
    t = table(f"training across GPUs: {what} (per-GPU memory; checkpointing on)", "option", ("GPUs", "right"),
              ("needs GiB per GPU at batch 1", "right"), ("max micro-batch", "right"),
              ("host RAM per node (GiB)", "right"))
    for r in result.scale_out:
        if r.error:
            _error_row(t, r.option, r.error, 5)
            continue
        if r.fits:
            gpus = str(r.gpus)
        elif result.num_gpus:
            gpus = "[red]does not fit[/]"
        else:  # DDP replicas never need less per GPU; sharded options were tried up to max(GPU_COUNTS)
            gpus = "[red]never (replicas)[/]" if r.setup.sharding == "ddp" else "[red]> 512[/]"
        host = _gib(r.host_bytes_per_node) if r.host_bytes_per_node else ""
        t.add_row(r.option, gpus, _gib(r.need_bytes_at_batch_1), str(r.max_batch_size) if r.fits else "0", host)
    return t


def fit_verdict(result) -> str:
    """One line first: which training and inference options fit one GPU (the best micro-batch of each kind), else
    the fewest GPUs a multi-GPU option needs."""
    g = result.gpu
    train = [r for r in result.rows if r.fits and r.setup.mode == "train"]
    infer = [r for r in result.rows if r.fits and r.setup.mode == "infer"]
    up_to = lambda rows: ", ".join(f"{r.option} up to batch {r.max_batch_size}" for r in rows)
    trains = any(r.setup.mode == "train" for r in result.rows)  # a stored-quantized upload shows serving alone
    parts = [f"trains with {up_to(train)}" if train else "no training option fits one GPU"] if trains else []
    if infer:
        parts.append(f"serves with {up_to(infer)}")
    elif any(r.setup.mode == "infer" for r in result.rows):
        parts.append("no inference option fits")
    several = [r for r in result.scale_out if r.fits and r.gpus > 1]
    if not train and several:
        fewest = min(several, key=lambda r: r.gpus)
        parts.append(f"fewest GPUs to train: {fewest.gpus} ({fewest.option})")
    head = "[green]fits[/]" if result.any_fits else "[red]does not fit[/]"
    return (f"{head}: {result.model} on {g.name} (budget {_gib(result.budget_bytes)} GiB, seq_len {result.seq_len}): "
            + "; ".join(parts))


def print_fit(result, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(fit_verdict(result), soft_wrap=True)
    console.print(fit_table(result))
    if not result.any_fits:
        console.print("[red]No option fits on one GPU[/]: try a shorter --seq-len, a larger GPU, or several GPUs "
                      "(below).")
    if result.scale_out:
        console.print(scale_out_table(result))


def _id_column(t: Table, name: str, ids, **kw) -> None:
    """A column of identifiers or exact figures the user copies: never cut with an ellipsis, however narrow the
    terminal (the other columns fold instead)."""
    t.add_column(name, no_wrap=True, min_width=max(map(len, ids), default=0), **kw)


def print_models(index: dict, console: Console | None = None) -> None:
    t = Table(title=f"built-in model catalog: {len(index)} models (a variant answers from its base's config.json)")
    rows = [(mid, row["model_type"], fmt_count(row["params_total"]),
             ", ".join(([row["variant_of"]] if row.get("variant_of") else []) + row["aliases"]))
            for mid, row in sorted(index.items(), key=lambda kv: kv[0].lower())]
    _id_column(t, "model", [r[0] for r in rows])
    _id_column(t, "type", [r[1] for r in rows])
    _id_column(t, "params", [r[2] for r in rows], justify="right")  # exact counts and kinds: models --json
    t.add_column("answers from / aliases", overflow="fold")
    for r in rows:
        t.add_row(*r)
    (console or make_console()).print(t)


def print_gpus(gpus, console: Console | None = None) -> None:
    t = Table(title="GPU catalog (memory as the vendor states it: GB = GiB)")
    _id_column(t, "name", [g.name for g in gpus])
    for col in ("GiB", "compute", "bf16"):
        t.add_column(col)
    t.add_column("variant of / aliases", overflow="fold")
    for g in gpus:
        t.add_row(g.name, _gib(g.memory_bytes), g.compute_capability or g.architecture, "yes" if g.bf16 else "no",
                  ", ".join(g.aliases))
    (console or make_console()).print(t)


def replay_line(r: dict) -> str:
    """plan --replay: which micro-batches the caching allocator's replay fitted under the allocator's limit."""
    if "skipped" in r:
        return f"[yellow]allocator replay skipped[/]: {r['skipped']}"
    tried = ", ".join(f"{b}: {_gib(x['need_bytes'])} GiB" + ("" if x["fits"] else " [red]OOM[/]")
                      for b, x in r["replayed"].items())
    if not r["largest_batch_size"]:
        return (f"[red]allocator replay[/]: no micro-batch fits the {_gib(r['limit_bytes'])} GiB limit (needs by "
                f"micro-batch: {tried}); the plan is the estimate's: lower the batch or the sequence length")
    split = (f"; the plan takes {r['batch_size']} x {r['grad_accum']} accumulation steps for the effective batch"
             if r["batch_size"] != r["largest_batch_size"] else "")
    return (f"allocator replay, needs by micro-batch against the {_gib(r['limit_bytes'])} GiB limit: {tried}; largest "
            f"fitting {r['largest_batch_size']} (closed-form plan: {r['estimate_batch_size']}){split}")


def serving_verdict(plan) -> str:
    """One line: the most faithful checkpoint format that serves the batch asked for, and what does not."""
    c, where = plan.choice, f"{plan.model} on {plan.gpu.name}"
    if c is None:
        best = max(plan.rows, key=lambda r: r.max_batch, default=None)
        more = (f"; the most any format serves: batch {best.max_batch} ({best.option})"
                if best and best.max_batch else "")
        return f"does not serve: no checkpoint format serves batch {plan.batch_size} of {where}{more}"
    worse = [r.option for r in plan.rows[:plan.rows.index(c)]]
    skipped = f"; {', '.join(worse)} cannot" if worse else ""
    return f"serves: {where} with {c.option} up to batch {c.max_batch} (batch {plan.batch_size} asked{skipped})"


def print_serving(plan, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(serving_verdict(plan), soft_wrap=True)
    first = plan.rows[0].setup if plan.rows else None
    tokens = f", {tokens_label(first)}" if first else ""
    t = table(f"{plan.model} served on {plan.gpu.name} (budget {_gib(plan.budget_bytes)} GiB{tokens})",
              "checkpoint", "largest batch", f"needs GiB at batch {plan.batch_size}")
    for r in plan.rows:
        if r.error:
            _error_row(t, r.option, r.error, 3)
        else:
            t.add_row(r.option, str(r.max_batch) if r.max_batch else "none", _gib(r.need_bytes))
    console.print(t)


def print_plan(plan, written: str | None = None, console: Console | None = None) -> None:
    """The chosen setup with its breakdown, the budget, and the alternatives with why each lost."""

    console = console or make_console()
    g = plan.gpu
    head = (f"{plan.model} on {g.name} ({_gib(g.memory_bytes)} GiB) · prefer {plan.prefer} · "
            f"effective batch {plan.effective_batch}")
    if not plan.fits:
        console.print(f"[red]Nothing fits[/] {head}")
        if plan.smallest:
            console.print(f"smallest setup: {describe(plan.smallest.setup)} — {plan.smallest.reason}")
        for tip in plan.suggestions:
            console.print(f"  - {tip}")
        return
    console.print(f"[bold]{head}[/]")
    for tip in plan.suggestions:
        console.print(f"[yellow]{tip}[/]")
    console.print(f"[green]plan[/]: {describe(plan.setup)}"
                  + (f" (effective batch {plan.achieved_effective_batch})"
                     if plan.achieved_effective_batch != plan.effective_batch else ""))
    console.print(estimate_table(plan.estimate))
    console.print(f"needs {_gib(need_bytes(plan.estimate))} GiB ({need_terms(plan.estimate)}) of the budget "
                  f"{_gib(plan.budget_bytes)} GiB = "
                  f"{_gib(g.memory_bytes)} GiB - headroom {_gib(plan.headroom_bytes)} GiB ({plan.headroom:.1%} of the "
                  f"{_gib(plan.usable_bytes)} GiB usable beyond the CUDA context); spare: {_gib(plan.spare_bytes)} GiB"
                  + ("; the allocator replay below sets the micro-batch (the need is a bound)"
                     if "replayed" in plan.replay else ""))
    if "closed_form" in plan.replay:
        console.print(f"[dim]micro-batch from the closed-form fit test, a bound: {plan.replay['closed_form']}[/]")
    elif plan.replay:
        console.print(replay_line(plan.replay))
    if plan.alternatives:
        t = table("alternatives", "setup", ("fits", "center"), ("needs GiB", "right"), "why not chosen")
        for a in plan.alternatives:
            t.add_row(describe(a.setup), "yes" if a.fits else "[red]no[/]", _gib(a.need_bytes), a.reason)
        console.print(t)
    if written:
        script = "train_trl_with_plan.py" if plan.setup.trainer != "hf" else "train_with_plan.py"
        console.print(f"wrote {written} (load it with memplan.load_plan; examples/{script} trains from it)")
        if plan.setup.sharding != "none":
            from memplan.planner.export import launcher_paths  # lazily: pydantic and yaml, for plans only

            acc, ds = launcher_paths(written)
            extra = f" and {ds}" if plan.setup.engine == "deepspeed" else ""
            console.print(f"wrote {acc}{extra}: accelerate launch --config_file {acc} "
                          f"examples/train_with_plan.py {written}")


def print_trace(result, comparison=None, console: Console | None = None) -> None:
    """Traced categories at the peak and per-phase peaks; with the estimate beside them when compared."""
    console = console or make_console()
    s = result.setup
    t = Table(title=f"trace: {result.model} · {'infer' if s.mode == 'infer' else s.technique} · {s.precision}"
              + (f" · {s.quant}" if s.quant else "")
              + f" · batch {s.batch_size} x {tokens_label(s)}" + (" · grad ckpt" if s.grad_ckpt else ""),
              title_justify="left")
    t.add_column("at the peak")
    t.add_column("traced GiB", justify="right")
    if comparison:
        t.add_column("estimated GiB", justify="right")
    for name, value in result.components.items():
        row = [name.replace("_", " "), _gib(value)]
        if comparison:
            row.append(_gib(comparison["estimated_components"][name]))
        t.add_row(*row)
    t.add_section()
    row = [f"peak of live tensors ({result.peak_phase})", _gib(result.peak_tensor_bytes)]
    if comparison:
        row.append(f"{_gib(comparison['estimated_peak_tensor_bytes'])} ({comparison['estimated_peak_phase']})")
    t.add_row(*row, style="bold")
    for label, value, est in (("max_memory_allocated (allocator replay)", result.peak_allocated_bytes,
                               "estimated_peak_allocated_bytes"),
                              ("peak reserved (allocator replay)", result.peak_reserved_bytes,
                               "estimated_peak_reserved_bytes"),
                              ("allocator need (smallest cap it fits)", result.allocator_need_bytes,
                               "estimated_allocator_need_bytes")):
        if value is not None:
            t.add_row(label, _gib(value), *([_gib(comparison[est])] if comparison else []))
    console.print(t)
    console.print("phase peaks (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in result.phases.items()))
    if comparison:
        console.print(f"estimate vs trace: {100 * comparison['rel_error']:+.2f}% (the estimate without the cuBLAS "
                      "workspace, which only CUDA allocates)")
    if result.paged_bytes:
        console.print(f"paged optimizer state outside the allocator: {_gib(result.paged_bytes)} GiB")
    for note in result.notes:
        console.print(note)


def validation_rows(m, est) -> list[dict]:
    """Predicted vs measured for each quantity the measurement has (CPU: allocated less the cuBLAS workspace)."""
    from memplan.tracer.training import comparable_estimate_bytes  # lazily: the validator's output only

    cpu = m.device == "cpu"  # the tracer's accounting: live tensors, no allocator blocks
    pairs = [("peak allocated", "peak_tensor_bytes" if cpu else "peak_allocated_bytes",
              comparable_estimate_bytes(est) if cpu else est.peak_allocated_bytes, m.allocated_bytes),
             ("peak reserved", "peak_reserved_bytes", est.peak_reserved_bytes, m.reserved_bytes),
             ("device total (NVML)", "device_total_bytes", est.device_total_bytes, m.device_bytes),
             ("CUDA context", "cuda_context_bytes", est.components.get("cuda_context", 0), m.cuda_context_bytes)]
    return [{"quantity": q, "key": k, "predicted_bytes": p, "measured_bytes": v,
             "rel_error": (p - v) / v if v else None} for q, k, p, v in pairs if v is not None]


def print_validation(model: str, setup, m, rows, console: Console | None = None) -> None:
    console = console or make_console()
    t = Table(title=f"{model} · {setup.mode} · {setup.technique} · {setup.precision} · batch {setup.batch_size} x "
                    f"seq {setup.seq_len} · measured on {m.environment.get('gpu') or m.device}", title_justify="left")
    for col in ("quantity", "predicted GiB", "measured GiB", "error"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for r in rows:
        err = "" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
        t.add_row(r["quantity"], _gib(r["predicted_bytes"]), _gib(r["measured_bytes"]), err)
    console.print(t)
    if m.status != "ok":
        console.print(f"[red]{m.status}[/]: {m.error}")
    elif m.phase_allocated:
        console.print("measured peak per phase (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in m.phase_allocated.items()))


def print_check(result, report_path: str, console: Console | None = None) -> None:
    from memplan.measure.gate import error_text, summary  # lazily: the check command's output only

    console = console or make_console()
    # a narrow terminal (COLUMNS) or CI log: no vertical rules, figures and verdicts never wrap or get cut, the words
    # fold, and the notes follow the table keyed by row number
    t = Table(title=f"memplan check: {'PASS' if result.ok else 'FAIL'} ({len(result.rows)} rows; GiB)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("model / setup", overflow="fold", min_width=18)
    t.add_column("quantity", overflow="fold", max_width=12)
    for col in ("meas", "pred", "error", "tol"):
        t.add_column(col, justify="right", no_wrap=True)

    style = {"fail": "red", "pass": "green", "info": "yellow", "skip": "dim"}
    notes = []
    for n, r in enumerate(result.worst_first(), 1):
        t.add_row(str(n), f"[{style[r.verdict]}]{r.verdict}[/]", f"{r.model}\n{r.label}", r.quantity,
                  "" if r.measured_bytes is None else _gib(r.measured_bytes),
                  "" if r.predicted_bytes is None else _gib(r.predicted_bytes), error_text(r), f"{r.tolerance:.0%}")
        if r.reason:
            notes.append(f"#{n} {r.verdict}: {r.reason}")
    console.print(t)
    for line in notes + [summary(result)]:
        console.print(line, markup=False, highlight=False)
    console.print(f"report written to {report_path}")
