"""Shared pieces of the command line: one --flag per Setup field, fractions, error handling, JSON output, the
MODEL argument. The command modules (cli.measure, cli.doctor, cli.plot) import them; cli.main imports those
modules and registers their commands on its click group.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import typing
from pathlib import Path

import click

from memplan.errors import BadInput, MemplanError
from memplan.setup import (ATTN_IMPLS, MODES, NEW_TOKENS, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTS, SHARDINGS,
                           TASK_NAMES, TECHNIQUES, TRAINERS, TRL_DEFAULTS, VLLM_MODES, Setup, parse_targets,
                           parse_trainable)
from memplan.model.catalog import catalog_id, load_spec, model_notes
from memplan.planner.budget import DEFAULT_HEADROOM, REPLAY_HEADROOM

_CHOICES = {"mode": MODES, "technique": TECHNIQUES, "precision": PRECISIONS, "quant": QUANTS,
            "optimizer": OPTIMIZERS, "attn_impl": ATTN_IMPLS, "sharding": SHARDINGS, "offload": OFFLOADS,
            "train_new_tokens": NEW_TOKENS, "task": TASK_NAMES, "trainer": TRAINERS, "vllm_mode": VLLM_MODES}
TASK_HELP = ("the head your script builds: seq-cls (AutoModelForSequenceClassification), token-cls, masked-lm, "
             "seq2seq, causal-lm; default: the language-model head the config names")
_HELP = {
    "task": TASK_HELP,
    "lora_targets": "LoRA modules, comma-separated (q_proj,v_proj) or all-linear; default: peft's per-model default",
    "trainable": "freeze: N (train the last N blocks) or comma-separated parameter-name patterns",
    "trainer": "hf: transformers' Trainer; sft, dpo, grpo: TRL's SFTTrainer, DPOTrainer, GRPOTrainer (with TRL's "
               "defaults unless given: --precision bf16-mixed --grad-ckpt)",
    "packing": "sft: BFD packing (SFTConfig.packing), which makes the batches padding-free",
    "padding_free": "sft: the micro-batch as one row of batch-size x seq-len tokens (SFTConfig.padding_free)",
    "precompute_ref_log_probs": "dpo: reference log-probs computed before training: no reference model or forward",
    "activation_offloading": "sft, dpo: saved activations copied to pinned host memory in the forward and brought "
                             "back in the backward (SFTConfig/DPOConfig.activation_offloading)",
    "num_generations": "grpo: completions per prompt (default 8); --batch-size counts completions",
    "max_completion_length": "grpo: tokens generated per completion (default 512); --prompt-len (else --seq-len) "
                             "is the prompt",
    "beta": "grpo: KL coefficient (default 0.0); > 0 adds the reference model (full) or an adapter-off pass (LoRA)",
    "use_vllm": "grpo: vLLM generates instead of model.generate()",
    "steps_per_generation": "grpo: micro-batches one generation serves (default --grad-accum): generate() runs "
                            "batch-size x this many completions; fewer than --grad-accum runs it with the "
                            "gradients alive",
    "vllm_mode": "grpo --use-vllm: colocate (on this card) or server (another GPU)",
    "vllm_gpu_memory_utilization": "grpo --use-vllm colocate: the fraction of the card's memory vLLM takes (default "
                                   "0.3)",
    "padded": "batches hold padding, as a padding collator makes them (sdpa then keeps a mask per layer); "
              "default: no padding (equal-length or packed batches), except for plan, whose config pads",
}


def setup_options(func):
    """Add one --flag per Setup field (names with dashes; choices from the Literal vocabularies)."""
    hints = typing.get_type_hints(Setup)
    for f in reversed(dataclasses.fields(Setup)):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        kw = {"default": None, "help": _HELP.get(f.name, f"Setup.{f.name} (default {f.default!r})")}
        if f.name in _CHOICES:
            opt = click.option(flag, type=click.Choice(_CHOICES[f.name]), **kw)
        elif hint is bool:
            opt = click.option(f"{flag}/--no-{flag[2:]}", **kw)
        elif f.name in ("lora_targets", "trainable"):
            opt = click.option(flag, type=str, **kw)
        elif float in typing.get_args(hint) or hint is float:
            opt = click.option(flag, type=float, **kw)
        else:
            opt = click.option(flag, type=int, **kw)
        func = opt(func)
    return func


def given_setup_fields(options: dict, spec=None, trl_defaults: bool = True) -> dict:
    """The Setup fields the user set on the command line, parsed (target lists split, block counts as ints); with
    the model's `spec`, a pre-quantized upload's bitsandbytes format as the quant unless --quant was given; with
    --trainer sft/dpo/grpo, TRL's precision and checkpointing defaults where unset (trl_defaults; plan searches
    them instead)."""
    names = {f.name for f in dataclasses.fields(Setup)}
    given = {k: v for k, v in options.items() if k in names and v is not None}
    if "lora_targets" in given:
        given["lora_targets"] = parse_targets(given["lora_targets"])
    if "trainable" in given:
        given["trainable"] = parse_trainable(given["trainable"])
    if spec is not None and spec.checkpoint_quant and "quant" not in given:
        given["quant"] = spec.checkpoint_quant
        if spec.checkpoint_group_size and "group_size" not in given:  # its quantization_config's groups
            given["group_size"] = spec.checkpoint_group_size
    if trl_defaults and given.get("trainer") in TRL_DEFAULTS:  # what TRL's configs default to, where unset
        given = {**TRL_DEFAULTS[given["trainer"]], **given}
    return given


def setup_from_options(options: dict, spec=None) -> Setup:
    """Setup from the parsed flags (unset flags keep the Setup defaults); raises SetupError listing all problems.
    With the model's `spec`, a pre-quantized upload's format is the quant unless --quant was given."""
    return Setup(**given_setup_fields(options, spec))


def parse_fraction(value: str, option: str, zero_ok: bool = False, one_ok: bool = True) -> float:
    """A fraction given as 0.05 or 5%, for `option`; BadInput naming the option and its range otherwise (NaN
    and infinities included)."""
    text = value.strip()
    try:
        x = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise BadInput(f"{option} {value!r}: give a fraction or a percentage, e.g. 0.05 or 5%") from None
    low, high = ("[0%" if zero_ok else "(0%"), ("100%]" if one_ok else "100%)")
    if not ((0 <= x if zero_ok else 0 < x) and (x <= 1 if one_ok else x < 1)):
        raise BadInput(f"{option} must be in {low}, {high}, got {value!r}")
    return x


def _parse_headroom(ctx, param, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_fraction(value, "--headroom", zero_ok=True, one_ok=False)
    except BadInput as e:
        raise click.BadParameter(str(e).removeprefix("--headroom ")) from None


def headroom_option(func=None, *, replay: bool = False):
    """--headroom: the memory kept spare (memplan.planner.budget), the same default for fit, plan, doctor and plot; plan
    (replay=True) leaves it unset, so that --replay gets its own default."""
    if func is None:
        return lambda f: headroom_option(f, replay=replay)
    help_text = ("memory kept spare, as a share of the GPU memory beyond the CUDA context (a fraction or a "
                 "percentage)")
    if replay:
        return click.option("--headroom", default=None, callback=_parse_headroom,
                            help=f"{help_text}  [default: {DEFAULT_HEADROOM:.1%}; {REPLAY_HEADROOM:.0%} with "
                                 "--replay]")(func)
    return click.option("--headroom", default=f"{DEFAULT_HEADROOM:.1%}", show_default=True, callback=_parse_headroom,
                        help=help_text)(func)


def handle_errors(func):
    """MemplanError -> 'error: ...' on stderr and its exit code; never a traceback."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except MemplanError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
    return wrapper


def emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2))


def load_model(model: str, trust_remote_code: bool = False):
    """load_spec for a command's MODEL argument, saying so on stderr when a local path shadows a catalog id
    (a folder named gpt2 in the working directory is read, not the catalog's gpt2)."""
    spec = load_spec(model, trust_remote_code=trust_remote_code)
    for note in model_notes(spec):
        click.echo(f"note: {note}", err=True)
    shadowed = catalog_id(str(model).strip()) if Path(str(model).strip()).expanduser().exists() else None
    if shadowed:
        click.echo(f"note: using the local {model} ({spec.model_id}), not the catalog's {shadowed}; to use the "
                   f"catalog's, run from another folder or rename the local one", err=True)
    return spec


def format_options(func):
    """--format table|markdown|csv|json and --json (the same as --format json) as one `fmt` argument."""
    from memplan.cli.report import FORMATS

    @functools.wraps(func)
    def wrapper(*args, fmt, as_json, **kwargs):
        return func(*args, fmt="json" if as_json else fmt, **kwargs)
    wrapper = click.option("--json", "as_json", is_flag=True, help="print one JSON object (--format json)")(wrapper)
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="tables for a terminal, markdown, CSV (notes on stderr) or JSON")(wrapper)
