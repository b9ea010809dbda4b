"""Planner check (issue 6): does `memplan plan`'s micro-batch fit, and does it reach >= 90% of the largest batch
that really fits?

For each (model, card, pinned setup) pair the planner picks the micro-batch (accumulation pinned to 1, so the
micro-batch is the largest the planner believes fits with its headroom). On a real GPU, capped to the card's memory
(`--emulate`: set_per_process_memory_fraction to the card's memory less the measured CUDA context), we run

  planned      b                      must not OOM
  next         b + 1                  tells whether the planner was tight
  bound        max(b+2, floor(b/0.9)+1)  only when b + 1 fits: if this OOMs, the largest fitting batch is at most
                                      bound - 1 (memory is monotone in batch), and the planner reached >= 90% of it
                                      when b / (bound - 1) >= 0.9 - true from b = 9 on; below, b + 1 must OOM

Rows go to data/measured/planner-check.csv (validator format, resumable; `memplan check` gates them too); a run
under another transformers release than the device image's to planner-check-tX.Y.Z.csv, reported in
results/planner_check-tX.Y.Z.md by `report` run under that release.

Two planners are checked: the closed-form search (`memplan plan`) and `memplan plan --replay`, whose micro-batch
comes from replaying the caching allocator over traced steps (memplan/planner/refine.py). The replay plans are made here,
on the CPU, with the transformers release the GPU machine runs, and stored in benchmarks/results/planner_replay_plans.csv;
the GPU run measures their batches too. A verdict reads every batch measured for the pair, whichever planner's
run measured it.

    python benchmarks/planner_check.py plans [REGEX]   # here, under the device's transformers: the replay plans
    python benchmarks/planner_check.py run      # on the GPU machine
    python benchmarks/planner_check.py report   # anywhere: benchmarks/results/planner_check.md, exit 1 on failure
    python benchmarks/planner_check.py replay data/measured/planner-check-run1.csv   # today's plans, earlier rows
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "measured" / "planner-check.csv"
REPORT = ROOT / "benchmarks" / "results" / "planner_check.md"
PLANS = ROOT / "benchmarks" / "results" / "planner_replay_plans.csv"
#: the transformers release of the device image: its rows and report are OUT and REPORT; a run under another release
#: (a carried wheel: gpu_session.sh `wheels:DIR:--planner ...`) has its own (out_file, report_file), since the
#: planned batches move with the release (issue 43 item 8: t5-base on an RTX 4080 plans 7 under 5.17, 12 under 5.24)
IMAGE_RELEASE = "5.17.0"


def _release() -> str:
    import transformers
    return transformers.__version__


def out_file(release: str | None = None) -> Path:
    """The rows of the planner check under `release` (default: the installed transformers)."""
    release = release or _release()
    return OUT if release == IMAGE_RELEASE else OUT.with_name(f"planner-check-t{release}.csv")


def report_file(release: str | None = None) -> Path:
    release = release or _release()
    return REPORT if release == IMAGE_RELEASE else REPORT.with_name(f"planner_check-t{release}.md")


EFFECTIVE = 512  # cap on the planned micro-batch; no pair below comes near it

# (model, card, pinned Setup fields). Cards with bf16 (the H100 runs bf16 whatever card is emulated).
PAIRS: list[tuple[str, str, dict]] = [
    ("openai-community/gpt2", "RTX 3060", dict(technique="full", precision="bf16-mixed", seq_len=1024)),
    ("google-bert/bert-large-uncased", "RTX 3060", dict(technique="full", precision="fp32", seq_len=512)),
    ("google-t5/t5-base", "RTX 4080", dict(technique="full", precision="bf16-mixed", seq_len=512)),
    ("facebook/bart-large", "RTX 3060", dict(technique="lora", precision="bf16-mixed", seq_len=512)),
    ("meta-llama/Llama-3.2-1B", "RTX 4090", dict(technique="full", precision="bf16", optimizer="adamw-8bit",
                                                 grad_ckpt=True, seq_len=2048)),
    ("meta-llama/Llama-3.2-1B", "RTX 3070", dict(technique="lora", precision="bf16", seq_len=1024)),
    ("Qwen/Qwen2.5-1.5B", "RTX 3060", dict(technique="qlora", precision="bf16", grad_ckpt=True, seq_len=1024)),
    ("openai-community/gpt2-xl", "A10", dict(technique="full", precision="bf16", optimizer="adafactor",
                                             grad_ckpt=True, seq_len=1024)),
    ("meta-llama/Llama-2-7b-hf", "RTX 3060", dict(technique="qlora", precision="bf16", grad_ckpt=True, seq_len=512)),
    ("mistralai/Mistral-7B-v0.1", "A100 40GB", dict(technique="lora", precision="bf16", grad_ckpt=True,
                                                    seq_len=2048)),
    ("meta-llama/Meta-Llama-3-8B", "RTX 4090", dict(technique="qlora", precision="bf16", grad_ckpt=True,
                                                    seq_len=1024)),
    # TRL's trainers (issue 43 item 7): DPO with its reference (peft's disabled adapter; a second model in full),
    # GRPO with generate() (the micro-batch in whole groups of num_generations)
    ("Qwen/Qwen2.5-0.5B", "RTX 3060", dict(trainer="dpo", technique="lora", precision="bf16-mixed", grad_ckpt=True,
                                           seq_len=1024)),
    ("meta-llama/Llama-3.2-1B", "A10", dict(trainer="dpo", technique="full", precision="bf16", grad_ckpt=True,
                                            seq_len=1024)),
    ("Qwen/Qwen2.5-0.5B", "RTX 4060 Ti 16GB", dict(trainer="grpo", technique="lora", precision="bf16-mixed",
                                                   grad_ckpt=True, seq_len=256, max_completion_length=256,
                                                   num_generations=4)),
    ("meta-llama/Llama-3.2-1B", "L4", dict(trainer="grpo", technique="lora", precision="bf16-mixed", grad_ckpt=True,
                                           seq_len=256, max_completion_length=512, num_generations=8)),
]
BASE = dict(attn_impl="sdpa", grad_accum=1, grad_ckpt=False)
#: each pair's card -> the card `planner_check.py plans` also plans it on with the default command, from the cache
#: the pair's --replay left (the replay's reach beyond the card it was made for)
OTHER_CARD = {"RTX 3060": "RTX 4060 Ti 16GB", "RTX 4080": "RTX 4090", "RTX 4090": "A100 40GB", "RTX 3070": "RTX 3060",
              "A10": "L4", "A100 40GB": "A100 80GB", "RTX 4060 Ti 16GB": "RTX 4090", "L4": "A10"}


def planned(model: str, card: str, pinned: dict):
    """The planner's Setup for this pair (its micro-batch is the one under test)."""
    from memplan.planner.search import plan
    p = plan(model, card, effective_batch=EFFECTIVE, replay=False, **{**BASE, **pinned})
    if p.setup is None:
        raise SystemExit(f"planner found nothing that fits for {model} on {card}")
    return p.setup


def bound_batch(b: int) -> int:
    """The batch whose OOM (with b + 1 fitting) shows the planner reached >= 90% of the largest fitting batch."""
    return max(b + 2, math.floor(b / 0.9) + 1)


def _runs(setup, batch: int) -> bool:
    """Whether the setup is valid at this micro-batch: GRPO's generation batch must hold whole groups of
    num_generations (setup.trainer_problems)."""
    from memplan.errors import SetupError
    try:
        dataclasses.replace(setup, batch_size=batch)
        return True
    except SetupError:
        return False


def runnable_batch(setup, b: int) -> int:
    """The smallest micro-batch from b up that the setup can run (for GRPO the next whole group, not b + 1)."""
    found = next((batch for batch in range(b, b + 4096) if _runs(setup, batch)), None)
    if found is None:
        raise SystemExit(f"no runnable micro-batch from {b} up for {setup}")
    return found


def runnable_below(setup, n: int) -> int:
    """The largest micro-batch under n that the setup can run (n - 1 but for GRPO's whole groups)."""
    return next((batch for batch in range(n - 1, 0, -1) if _runs(setup, batch)), n - 1)


def check_pair(model: str, card: str, pinned: dict, measure, replay_batch: int | None = None) -> dict[str, str]:
    """Run the planned batch, the next one, and the 90% bound when the next one fits. measure(job, notes) runs one
    Job (emulating `card`) and returns its status. replay_batch: check `plan --replay`'s micro-batch instead of the
    closed-form planner's (same setup otherwise). Returns {role: status}."""
    from memplan.measure.sweep import Job
    setup = planned(model, card, pinned)
    b = replay_batch or setup.batch_size
    label = "replay " if replay_batch else ""
    tried: dict[str, str] = {}
    following = runnable_batch(setup, b + 1)
    for role, batch in (("planned", b), ("next", following),
                        ("bound", runnable_batch(setup, max(bound_batch(b), following + 1)))):
        if role == "bound" and tried.get("next") != "ok":
            break
        job = Job(model, dataclasses.replace(setup, batch_size=batch), card)
        tried[role] = measure(job, f"planner check {label}{role} ({label or 'planned '}micro-batch {b})")
        print(f"{model:32s} {card:10s} {label}{role:8s} batch {batch:4d}: {tried[role]}", flush=True)
    return tried


def replay_plans(only: str | None = None) -> None:
    """`plan --replay` for every pair (CPU; minutes), into PLANS with the library versions it ran under; and the
    default command (replay=None: the replay where it is cached) before and after it, with the seconds each took.
    Runs on an empty replay cache of its own, so the first default is the closed form and --replay traces.
    only: a regex over "model card"; the other pairs keep their stored rows. Each pair's row is written as it is
    made (a GRPO pair's replays take many minutes: see docs/PLANNER.md)."""
    import csv
    import io
    import os
    import tempfile
    import time

    import peft
    import torch
    import transformers

    from memplan.fileio import write_text_atomic
    from memplan.planner.search import plan
    os.environ["MEMPLAN_CACHE"] = tempfile.mkdtemp(prefix="memplan-planner-check-")
    header = ["model", "card", "estimate_batch", "replay_batch", "replayed", "cold_default_batch", "cold_default_s",
              "replay_s", "default_batch", "default_s", "other_card", "other_batch", "other_s", "other_from",
              "transformers", "peft", "torch"]
    stored = stored_plans()
    release = _release()

    def save() -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, header, lineterminator="\n")
        w.writeheader()
        w.writerows(stored[key] for key in sorted(stored, key=lambda k: (k[2], _order(k[0], k[1]))))
        write_text_atomic(PLANS, buf.getvalue())

    def timed(on=None, **kw):
        t = time.perf_counter()
        p = plan(model, on or card, effective_batch=EFFECTIVE, **kw, **{**BASE, **pinned})
        return p, time.perf_counter() - t
    for model, card, pinned in PAIRS:
        if only and not re.search(only, f"{model} {card}"):
            continue
        cold, cold_s = timed(replay=None)
        p, replay_s = timed(replay=True)
        warm, warm_s = timed(replay=None)
        # the same pinned setup on another card, after --replay on this one: the cached line answers there too
        # (memplan.replay.affine) where the search picks the same shape and the run is affine in the micro-batch
        other, other_s = timed(on=OTHER_CARD[card], replay=None)
        other_from = "replay" if "replayed" in (other.replay or {}) else \
            "closed form: " + (other.replay or {}).get("closed_form", "")[:60]
        r = p.replay
        tried = " ".join(f"{b}:{'ok' if x['fits'] else 'oom'}" for b, x in r["replayed"].items())
        stored[model, card, release] = dict(zip(header, [
            model, card, r["estimate_batch_size"], p.setup.batch_size, tried, cold.setup.batch_size, f"{cold_s:.2f}",
            f"{replay_s:.1f}", warm.setup.batch_size, f"{warm_s:.2f}", OTHER_CARD[card], other.setup.batch_size,
            f"{other_s:.2f}", other_from, transformers.__version__, peft.__version__, torch.__version__]))
        save()
        print(model, card, r["estimate_batch_size"], "->", p.setup.batch_size, tried,
              f"default {cold.setup.batch_size} ({cold_s:.1f} s) -> {warm.setup.batch_size} ({warm_s:.2f} s), "
              f"--replay {replay_s:.0f} s", flush=True)


def _order(model: str, card: str) -> int:
    return next((i for i, (m, c, _) in enumerate(PAIRS) if (m, c) == (model, card)), len(PAIRS))


def stored_plans() -> dict[tuple[str, str, str], dict]:
    """(model, card, transformers release) -> the row of PLANS (`plans` made it under that release)."""
    import csv
    if not PLANS.exists():
        return {}
    return {(r["model"], r["card"], r["transformers"]): r for r in csv.DictReader(open(PLANS))}


def stored_replay_batches() -> dict[tuple[str, str], int]:
    """(model, card) -> `plan --replay`'s micro-batch, from PLANS where it was made under the transformers installed
    here (the batch depends on the release's code paths)."""
    release = _release()
    return {(m, c): int(r["replay_batch"]) for (m, c, v), r in stored_plans().items() if v == release}


def run() -> None:
    """One pair after another, each run alone on the GPU (benchmarks/gpu_pool.py --planner runs them side by side)."""
    from memplan.measure.rows import read_rows
    from memplan.measure.sweep import run_sweep
    from memplan.measure.runner import require_cuda
    require_cuda()

    out = out_file()

    def measure(job, notes):
        run_sweep([job], out, notes=notes)
        return next(r["status"] for r in read_rows(out) if r["key"] == job.key("cuda"))
    replays = stored_replay_batches()
    for model, card, pinned in PAIRS:
        check_pair(model, card, pinned, measure)
        if (model, card) in replays:
            check_pair(model, card, pinned, measure, replays[model, card])


def verdict(b: int | None, status: dict[int, str], below=lambda n: n - 1) -> tuple[str, str, bool]:
    """(largest fitting, planner / largest, pass) for planned micro-batch b given the statuses measured per batch:
    b must fit and an OOM above it must bound the largest fitting batch to within b / 0.9 (memory is monotone in
    the batch). below(n): the largest batch under n the setup can run (GRPO: whole groups; runnable_below)."""
    if b is None or b not in status:
        return "", "", False
    if status[b] != "ok":
        return "", "planned OOMed", False
    above = [x for x, st in status.items() if x > b and st == "oom"]
    if not above:
        return f">= {max(x for x, st in status.items() if st == 'ok')}", "", False
    smallest_oom = min(above)
    largest = max(x for x, st in status.items() if st == "ok" and x < smallest_oom)
    ratio = b / below(smallest_oom)
    exact = largest == below(smallest_oom)
    return (str(largest) if exact else f"< {smallest_oom}"), f">= {ratio:.0%}", ratio >= 0.9


#: the Setup fields a measured row must share with today's plan to count for it (the micro-batch aside)
SAME = ("technique", "precision", "quant", "optimizer", "grad_ckpt", "seq_len", "padded", "trainer",
        "num_generations", "max_completion_length")
SAME_LORA = ("lora_r", "lora_targets")


def same_setup(row: dict, setup) -> bool:
    """Whether a measured row ran today's planned setup (the micro-batch aside): the planner's choice of rank,
    optimizer or checkpointing moves with its releases, and a verdict needs rows of the setup it plans."""
    def text(v) -> str:
        return "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    defaults = {f.name: f.default for f in dataclasses.fields(setup)}
    fields = SAME + (SAME_LORA if setup.technique in ("lora", "qlora") else ())
    # a row written before a field existed (or left empty) ran its default
    return all((row.get(f) or text(defaults[f])) == text(getattr(setup, f)) for f in fields)


def report() -> int:
    """Markdown tables (the closed-form planner, `plan --replay`, the default command) from the measured rows of
    today's planned setups; 1 when a planned batch OOMed or a planner fell below 90%."""
    from memplan.fileio import write_text_atomic
    from memplan.measure.rows import read_rows
    out, release = out_file(), _release()
    rows = read_rows(out) if out.exists() else []
    stored = {(m, c): r for (m, c, v), r in stored_plans().items() if v == release}
    lines = [f"# Planner check (issue 6), transformers {release}", "",
             "Planned micro-batch vs the largest that fits, on a GPU capped to each card's memory less the CUDA "
             f"context (`python benchmarks/planner_check.py`; rows in data/measured/{out.name}). A verdict "
             "reads every batch measured for the pair with today's planned setup (rank, targets, optimizer, "
             "checkpointing: rows of another setup do not count). Planned batches from "
             "results/planner_replay_plans.csv, made on the CPU under the GPU's transformers release "
             "(`planner_check.py plans`).", ""]
    modes = {"estimate": ("closed-form bound (`memplan plan --no-replay`, planned today; the default before "
                          "`--replay` has run)",
                          "cold_default_batch"),
             "replay": ("`memplan plan --replay` (caching-allocator replay)", "replay_batch"),
             "default": ("`memplan plan`, the default, once `--replay` has cached the setup's replays",
                         "default_batch")}
    failed = dict.fromkeys(modes, 0)
    for mode, (title, column) in modes.items():
        lines += [f"## {title}", "", "| model | card | setup | planned b | measured (batch: status) | largest fitting | "
                  "planner / largest | verdict |", "|---|---|---|---|---|---|---|---|"]
        for model, card, pinned in PAIRS:
            setup = planned(model, card, pinned)
            mine = [r for r in rows if r["model"] == model and f"emulating {card}" in r["notes"]
                    and "planner check" in r["notes"] and same_setup(r, setup)]
            status = {int(r["batch_size"]): r["status"] for r in mine}
            if mode == "estimate":  # today's closed form (milliseconds): never a stale stored batch
                b = setup.batch_size
            else:
                b = int(stored[model, card][column]) if stored.get((model, card), {}).get(column) else None
            largest, ratio, good = verdict(b, status, lambda n, setup=setup: runnable_below(setup, n))
            failed[mode] += not good
            seen = ", ".join(f"{x}: {st}" for x, st in sorted(status.items())) or "not measured"
            word = "pass" if good else ("FAIL" if ratio == "planned OOMed" or ratio.startswith(">=") else "open")
            desc = ", ".join(f"{k}={v}" for k, v in pinned.items())
            if setup.technique in ("lora", "qlora"):
                desc += f" (planned r={setup.lora_r} {setup.lora_targets})"
            lines.append(f"| {model} | {card} | {desc} | {b or ''} | {seen} | {largest} | {ratio} | {word} |")
        lines += ["", f"{len(PAIRS) - failed[mode]} of {len(PAIRS)} pairs pass (planned batch fits, planner >= 90% of "
                      "the largest fitting batch; open: the batches that decide it are not measured yet).", ""]
    if stored:
        lines += ["## What the default costs", "",
                  "Seconds of `plan()` in one process on 2 CPU cores (the CLI adds ~0.35 s of start-up): the "
                  "default on an empty cache (the closed form: today's batch, the seconds of the stored run), "
                  "`--replay` tracing, then the default again, on the pair's card and on another (the same pinned "
                  "setup, from what --replay cached: a line of the setup's events at every micro-batch, "
                  "memplan.replay.affine; GRPO over whole generation groups within one pass of TRL's head; DPO, "
                  "Liger and offloading are replayed per micro-batch).", "",
                  "| model | card | default, cold: b (s) | --replay: b (s) | default, cached: b (s) | "
                  "another card: b (s), from |",
                  "|---|---|---|---|---|---|"]
        for model, card, pinned in PAIRS:
            r = stored.get((model, card))
            if r and r.get("default_s"):
                cold = planned(model, card, pinned).batch_size  # today's closed form; the seconds are the stored run's
                other = f"{r['other_card']}: {r['other_batch']} ({r['other_s']}), {r['other_from']}" \
                    if r.get("other_card") else ""
                lines.append(f"| {model} | {card} | {cold} ({r['cold_default_s']}) | "
                             f"{r['replay_batch']} ({r['replay_s']}) | {r['default_batch']} ({r['default_s']}) | "
                             f"{other} |")
        lines.append("")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(report_file(), "\n".join(lines))
    print("\n".join(lines))
    return 1 if any(failed.values()) else 0


def replay(path: Path) -> int:
    """The planner as it is now against an earlier run's rows (no GPU): for each pair, the status measured at
    today's planned batch, at b + 1 and at the bound. Writes benchmarks/results/planner_check_replay.md; exit 1
    when a planned batch OOMed there or a batch the verdict needs was not measured."""
    import csv

    from memplan.fileio import write_text_atomic
    rows = list(csv.DictReader(open(path)))
    lines = [f"# Planner check replayed on {path.name}", "",
             "Today's planner against batches measured earlier (same pairs, same pinned setups). The runs' caps may "
             "differ from today's emulation (see their notes); this is not a substitute for a fresh run.", "",
             "| model | card | planned b | b | b+1 | bound | verdict |", "|---|---|---|---|---|---|---|"]
    failed = 0
    from memplan import libs
    padded = rows[0].get("padded", "") == "true"  # rows before Setup.padded ran unpadded batches
    for model, card, pinned in PAIRS:
        with libs.assume(transformers=rows[0].get("transformers")):  # the release the rows ran with
            b = planned(model, card, {**pinned, "padded": padded}).batch_size

        def status(batch: int) -> str:
            found = [r["status"] for r in rows if r["model"] == model and f"emulated {card} " in r["notes"]
                     and int(r["batch_size"]) == batch]
            return found[0] if found else "?"
        bound = bound_batch(b)
        got = (status(b), status(b + 1), status(bound))
        # the largest fitting batch is b when b + 1 OOMs, at most bound - 1 when only the bound did (run's verdict)
        good = got[0] == "ok" and (got[1] == "oom" or (got[1] == "ok" and got[2] == "oom" and b / (bound - 1) >= 0.9))
        failed += not good
        verdict = "pass" if good else ("FAIL (planned OOMed)" if got[0] == "oom" else "unknown" if "?" in got else "FAIL")
        lines.append(f"| {model} | {card} | {b} | {got[0]} | {got[1]} | {got[2]} @ {bound} | {verdict} |")
    lines += ["", f"{len(PAIRS) - failed} of {len(PAIRS)} pairs pass on these rows."]
    write_text_atomic(REPORT.with_name("planner_check_replay.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def show_plans() -> None:
    for model, card, pinned in PAIRS:
        s = planned(model, card, pinned)
        print(f"{model:32s} {card:10s} b={s.batch_size} {s.technique} {s.precision} ckpt={s.grad_ckpt} opt={s.optimizer}")


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "report"
    if cmd == "run":
        run()
    elif cmd == "plans":
        replay_plans(sys.argv[2] if len(sys.argv) > 2 else None)
    elif cmd == "show":
        show_plans()
    elif cmd == "replay":
        sys.exit(replay(Path(sys.argv[2])))
    else:
        sys.exit(report())
