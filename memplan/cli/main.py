"""memplan command line: a thin click group. Each command: parse -> core -> render.

Exit codes: 0 an answer, 1 "does not fit" (fit: no option fits), 2 bad input (unknown model/GPU, invalid setup,
malformed config; click usage errors too). --json prints one JSON object on stdout.
"""
from __future__ import annotations

import dataclasses
import sys

import click

from memplan.cli.doctor import doctor_command
from memplan.cli.measure import check_cmd, validate_cmd
from memplan.cli.options import (TASK_HELP, emit_json, format_options, given_setup_fields, handle_errors,
                                 headroom_option, load_model, setup_from_options, setup_options)
from memplan.cli.plot import plot_command
from memplan.cli.plots import write_breakdown_png
from memplan.cli.report import (output_console, print_estimate, print_fit, print_plan, print_serving, print_trace,
                                print_models, print_gpus)
from memplan.gpus import resolve_gpu, load_gpus
from memplan.errors import BadInput
from memplan.setup import TASK_NAMES, Setup
from memplan.estimator import breakdown
from memplan.model import catalog
from memplan.model.catalog import find_models
from memplan.planner import fit_table, search


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def main():
    """memplan: how much GPU memory will fine-tuning or serving a Hugging Face model take, and does it fit?"""


@main.command()
@click.argument("model")
@setup_options
@click.option("--trust-remote-code", is_flag=True, help="allow configs whose code lives in the model repository")
@format_options
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="also draw the components per phase as stacked bars (PNG/SVG/PDF)")
@click.option("--gpu", "gpu_name", help="estimate for this card (its cuBLAS workspace; colocated vLLM's share of its "
              "memory); --plot: draw its memory as a line")
@click.option("--memory", help="the card's memory, e.g. 12GiB (colocated vLLM's share); --plot: draw it as a line")
@handle_errors
def estimate(model, trust_remote_code, fmt, plot_path, gpu_name, memory, **options):
    """Itemised memory estimate of one setup: components, peak allocated/reserved and device total."""

    spec = load_model(model, trust_remote_code=trust_remote_code)
    setup = setup_from_options(options, spec)
    gpu = resolve_gpu(gpu_name, memory) if (gpu_name or memory) else None
    result = breakdown.estimator_for(gpu)(spec, setup) if gpu else breakdown.estimate(spec, setup)
    if plot_path:
        click.echo(f"wrote {write_breakdown_png(spec, setup, result, plot_path, gpu)}", err=fmt != "table")
    if fmt == "json":
        emit_json(result.to_dict())
    else:
        print_estimate(result, output_console(fmt))


@main.command()
@click.argument("model")
@click.option("--gpu", "gpu_name", help='GPU name, e.g. "RTX 3060", a100-80 (see `memplan gpus`)')
@click.option("--memory", help="memory budget instead of a GPU name, e.g. 12GiB, 24GB")
@click.option("--seq-len", type=click.IntRange(min=1, max=2**24), default=512, show_default=True,
              help="tokens per sample")
@click.option("--num-gpus", type=click.IntRange(min=1, max=2**16),
              help="training across exactly N such GPUs (default: the fewest that fit); > 8 means nodes of 8")
@headroom_option
@click.option("--task", type=click.Choice(TASK_NAMES), help=TASK_HELP)
@click.option("--trust-remote-code", is_flag=True)
@format_options
@handle_errors
def fit(model, gpu_name, memory, seq_len, num_gpus, headroom, task, trust_remote_code, fmt):
    """Will MODEL fit on a GPU? One row per common setup with the largest micro-batch that fits, then the
    multi-GPU training options (DeepSpeed ZeRO-3, FSDP, DDP) with the fewest GPUs each needs."""

    if seq_len < 1:
        raise click.BadParameter("must be >= 1", param_hint="--seq-len")
    spec = catalog.spec_for_task(load_model(model, trust_remote_code=trust_remote_code), task)
    result = fit_table.fit(spec, resolve_gpu(gpu_name, memory), seq_len, num_gpus=num_gpus, headroom=headroom)
    if fmt == "json":
        emit_json(result.to_dict())
    else:
        print_fit(result, output_console(fmt))
    fits = any(r.fits for r in result.scale_out) if num_gpus else result.any_fits
    sys.exit(0 if fits else 1)


@main.command()
@click.argument("model")
@click.option("--gpu", "gpu_name", help='GPU name, e.g. "RTX 3060" (see `memplan gpus`); default: the detected GPU')
@click.option("--memory", help="memory budget instead of a GPU name, e.g. 12GiB")
@click.option("--effective-batch", type=click.IntRange(min=1, max=2**24), default=32, show_default=True,
              help="samples per optimizer step (micro-batch x gradient accumulation)")
@click.option("--prefer", type=click.Choice(["quality", "speed", "memory"]), default="quality", show_default=True,
              help="what to maximise first (docs/PLANNER.md)")
@headroom_option(replay=True)
@click.option("--host-memory", help="RAM per node for CPU offload, e.g. 512GiB (default: this machine's RAM)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write the plan file (YAML or JSON)")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), help="plan file format (default: by extension)")
@click.option("--force", is_flag=True, help="-o: overwrite launcher files beside the plan that hold other content")
@click.option("--replay/--no-replay", default=None, help="set the micro-batch by replaying PyTorch's CUDA caching "
              "allocator over traced steps of the whole model (single GPU; seconds to a minute on the CPU the first "
              "time, GRPO a few minutes; then cached; docs/PLANNER.md); default: the replay when it is cached, else "
              "the closed-form bound")
@setup_options
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
@handle_errors
def plan(model, gpu_name, memory, effective_batch, prefer, headroom, host_memory, output, fmt, force, replay,
         trust_remote_code, as_json, **options):
    """Search the best training setup that fits a GPU; pin any setup flag (e.g. --technique lora --lora-r 16)."""

    spec = load_model(model, trust_remote_code=trust_remote_code)
    # validated with each candidate (a pin's problems are reported then); TRL's defaults are searched, not pinned
    pins = given_setup_fields(options, spec, trl_defaults=False)
    spec = catalog.spec_for_task(spec, pins.get("task"))  # the plan file names the task's class
    if pins.get("mode") == "infer":
        _plan_serving(spec, resolve_gpu(gpu_name, memory), pins, headroom, output, as_json)
    result = search.plan(spec, resolve_gpu(gpu_name, memory), effective_batch=effective_batch, prefer=prefer,
                         headroom=headroom, host_memory=host_memory, replay=replay, **pins)
    written = None
    if output and result.fits:
        from memplan.planner.export import write_plan  # lazily: pydantic and yaml, for plan files only

        written = str(write_plan(result, spec, output, fmt, force=force))
    if as_json:
        emit_json(dict(result.to_dict(), written=written))
    else:
        print_plan(result, written)
    sys.exit(0 if result.fits else 1)


#: the Setup fields a serving plan takes as given; the format (quant) is what it searches
SERVING_PINS = frozenset({"mode", "batch_size", "prompt_len", "seq_len", "new_tokens", "precision", "attn_impl",
                          "padded", "task"})


def _plan_serving(spec, gpu, pins: dict, headroom, output, as_json) -> None:
    """plan --mode infer: the most faithful checkpoint format that serves the batch asked for (planner.serving)."""
    from memplan.planner.fit_table import DEFAULT_NEW_TOKENS
    from memplan.planner.serving import plan_serving

    if output:
        raise BadInput("-o writes training plans; a serving plan is printed (use --json for a file)")
    if pins.get("quant") == spec.checkpoint_quant:  # an upload's own format, applied by itself
        pins = {k: v for k, v in pins.items() if k != "quant"}
    if "quant" in pins:
        raise BadInput("plan --mode infer searches the checkpoint format: drop --quant, or size that format with "
                       f"`memplan estimate {spec.model_id} --mode infer --quant {pins['quant']}`")
    training = sorted(set(pins) - SERVING_PINS)
    if training:
        flags = ", ".join("--" + f.replace("_", "-") for f in training)
        raise BadInput(f"plan --mode infer searches the checkpoint format and batch for serving: drop {flags} "
                       "(training flags), or plan training without --mode infer")
    base = Setup(**{**pins, "mode": "infer", "batch_size": pins.get("batch_size", 1),
                    "prompt_len": pins.get("prompt_len") or pins.get("seq_len") or 512,
                    "new_tokens": pins.get("new_tokens", DEFAULT_NEW_TOKENS),
                    "precision": pins.get("precision") or ("bf16" if gpu.bf16 else "fp16")})
    result = plan_serving(spec, gpu, base, **({"headroom": headroom} if headroom is not None else {}))
    if as_json:
        emit_json(result.to_dict())
    else:
        print_serving(result)
    sys.exit(0 if result.fits else 1)


@main.command("trace")
@click.argument("model")
@setup_options
@click.option("--layers", type=click.IntRange(min=1, max=1024),
              help="trace N and N+1 blocks and extrapolate to the full depth (N is raised to 2, and for freeze to "
                   "one more than its trainable blocks, as stated in the output)")
@click.option("--steps", type=click.IntRange(min=2, max=100), default=2, show_default=True,
              help="training steps to run")
@click.option("--compare/--no-compare", default=True, show_default=True, help="also show memplan's estimate")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (the estimate's keys)")
@handle_errors
def trace_cmd(model, layers, steps, compare, trust_remote_code, as_json, **options):
    """Run the real training step on fake tensors (no GPU) and report the measured peak: ground truth for the
    estimate. With --mode infer: the prefill and generate() that `memplan validate` runs, traced whole. With
    --sharding fsdp-full-shard|fsdp-shard-grad-op|zero1|zero2|zero3 --num-gpus N: rank 0 of real FSDP2 / DeepSpeed
    ZeRO over a fake process group (ZeRO on real small CPU tensors: cut the model with --layers)."""
    # lazily: torch, transformers and peft load only for the command that runs them (`memplan fit` stays fast)
    from memplan.tracer.sharded import trace_deepspeed, trace_sharded
    from memplan.tracer.training import compare as compare_fn, trace

    setup = setup_from_options(options)
    spec = load_model(model, trust_remote_code=trust_remote_code)
    if setup.sharding != "none":  # one rank over a fake process group (memplan.tracer.sharded)
        run = trace_deepspeed if setup.engine == "deepspeed" else trace_sharded
        result = run(spec, setup, layers=layers, steps=steps)
    else:
        result = trace(spec, setup, layers=layers, steps=steps)
    cmp = None
    if compare:
        cmp = compare_fn(result, breakdown.estimate(spec, setup))
    if as_json:
        emit_json(dict(result.to_dict(), comparison=cmp))
    else:
        print_trace(result, cmp)


@main.command()
@click.option("--search", "text", help="only ids containing TEXT (case-insensitive), e.g. --search qwen3")
@click.option("--family", help="only this model_type (transformers' name, e.g. llama, qwen3_moe, gemma3)")
@format_options
@handle_errors
def models(text, family, fmt):
    """List the built-in model catalog: every id memplan answers offline, its family and parameter count."""
    index = find_models(text, family)
    if fmt == "json":
        emit_json(index)
    else:
        print_models(index, output_console(fmt))


@main.command()
@format_options
@handle_errors
def gpus(fmt):
    """List the GPU catalog."""
    rows = load_gpus()
    if fmt == "json":
        emit_json([dataclasses.asdict(g) for g in rows])
    else:
        print_gpus(rows, output_console(fmt))


@main.command("refresh-catalog")
@handle_errors
def refresh_catalog():
    """Rebuild the model inventories after adding a config.json to memplan/data/models/configs/."""

    click.echo(f"{catalog.refresh_catalog(echo=click.echo)} models refreshed")


for _command in (validate_cmd, check_cmd, doctor_command, plot_command):
    main.add_command(_command)


if __name__ == "__main__":
    main()
