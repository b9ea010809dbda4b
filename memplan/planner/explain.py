"""Explaining a plan: short labels for setups, why each alternative lost, and what would make a plan fit when
nothing does. Used by memplan.planner.search.plan (and the reports, through describe)."""
from __future__ import annotations

import dataclasses

from memplan.errors import MemplanError
from memplan.gpus import load_gpus
from memplan.planner.budget import budget_bytes, fits
from memplan.planner.candidates import TECHNIQUE_ORDER
from memplan.planner.types import Alternative, Candidate, Plan
from memplan.planner.search import _Search
from memplan.setup import Setup, sharding_label
from memplan.units import fmt_gib


def describe(s: Setup) -> str:
    """A short human label: 'LoRA r=64 all-linear, bf16, adamw-fused, checkpointing, micro-batch 4 x 8'."""
    tech = {"full": "full fine-tune", "lora": "LoRA", "qlora": "QLoRA", "freeze": "freeze"}[s.technique]
    parts = [tech]
    if s.technique in ("lora", "qlora"):
        parts[0] += f" r={s.lora_r} " + ("all-linear" if s.lora_targets == "all-linear" else
                                          ",".join(s.lora_targets) if s.lora_targets else "default targets")
    if s.quant:
        parts.append(s.quant + (" + double quant" if s.double_quant else ""))
    if s.technique == "freeze":
        parts.append(f"trainable {s.trainable or 1}")
    parts += [s.precision, s.optimizer]
    if s.grad_ckpt:
        parts.append("checkpointing")
    if s.sharding != "none":
        parts.append(sharding_label(s))
    parts.append(f"micro-batch {s.batch_size} x {s.grad_accum}" + (" (padded)" if s.padded else ""))
    return ", ".join(parts)


def _speed_reason(s: Setup, best: Setup) -> str:
    what = "recomputes the forward in backward, " if s.grad_ckpt else ""
    if s.technique == "full" and best.technique != "full":
        what += "weight gradients for every parameter, "
    return f"slower: {what}micro-batch {s.batch_size} x {s.grad_accum} steps"


def _lost_reason(c: Candidate, best: Candidate, prefer: str) -> str:
    """Why a fitting candidate ranks below the chosen one, in the terms of the preference."""
    s, b = c.setup, best.setup
    if prefer == "memory" and c.need_bytes != best.need_bytes:
        return f"needs {fmt_gib(c.need_bytes - best.need_bytes)} more"
    if prefer == "speed" and c.key[:1] != best.key[:1]:
        return _speed_reason(s, b)
    if s.technique != b.technique:
        return f"{s.technique} ranks below {b.technique} for quality"
    if s.precision != b.precision:
        return f"precision {s.precision} ranks below {b.precision}"
    if s.lora_targets != b.lora_targets:
        return "fewer LoRA targets (peft's default, attention only)"
    if s.optimizer != b.optimizer:
        return f"{s.optimizer} ranks below {b.optimizer}"
    if s.lora_r != b.lora_r and s.technique in ("lora", "qlora"):
        return f"rank {s.lora_r} instead of {b.lora_r}"
    return _speed_reason(s, b)


def alternatives(search: _Search, setups, results, best_i: int, order, limit: int) -> tuple[Alternative, ...]:
    """What the choice beat: the most preferred candidate that does not fit and the one just above the choice
    (what more memory would buy), then the runner-up in preference order and the best fitting candidate of each
    other technique, each with the reason it lost."""
    best = results[best_i]
    out: list[Alternative] = []
    pos = order.index(best_i)
    failing = [results[i] for i in order[:pos] if i in results and not results[i].fits]
    for c in failing[:1] + failing[-1:] if len(failing) > 1 else failing:
        out.append(Alternative(c.setup, False, c.need_bytes,
                               f"does not fit: needs {fmt_gib(c.need_bytes)} at micro-batch "
                               f"{c.setup.batch_size}, budget {fmt_gib(search.budget)}"))

    def first_fitting(indices) -> Candidate | None:
        for i in indices:
            if i == best_i:
                continue
            if i not in results:
                if setups[i] is None:
                    continue
                try:
                    results[i] = search.evaluate(setups[i])
                except MemplanError:
                    continue
            if results[i].fits:
                return results[i]
        return None

    runners = [first_fitting(order[pos + 1:])]
    for tech in TECHNIQUE_ORDER:
        if tech != best.setup.technique:
            runners.append(first_fitting(i for i in order if setups.fields[i]["technique"] == tech))
    seen = set()
    for c in runners:
        if c is not None and c.setup not in seen and len(out) < limit + 2:
            seen.add(c.setup)
            out.append(Alternative(c.setup, True, c.need_bytes, _lost_reason(c, best, search.prefer)))
    return tuple(out)


def nothing_fits(search: _Search, setups, results, common) -> Plan:
    """Nothing fits: the setup needing least memory at micro-batch 1, and what would make it fit."""
    smallest = min(results.values(), key=lambda c: c.need_bytes)
    need = smallest.need_bytes
    s = smallest.setup
    tips = []
    headroom = common["headroom"]
    bigger = sorted((g for g in load_gpus() if budget_bytes(g.memory_bytes, headroom) >= need),
                    key=lambda g: g.memory_bytes)
    if bigger:
        tips.append(f"a larger GPU: {bigger[0].name} ({fmt_gib(bigger[0].memory_bytes)}) fits {describe(s)}")
    shorter = _largest_seq_len(search, s)
    if shorter:
        tips.append(f"a shorter sequence: --seq-len {shorter} fits on this GPU ({describe(dataclasses.replace(s, seq_len=shorter))})")
    if s.world_size == 1:
        tips.append("more GPUs: sharding the model (DeepSpeed ZeRO-3 / FSDP) splits weights and optimizer state; "
                    "`memplan plan` without --num-gpus finds the fewest GPUs that fit, --num-gpus N plans for N")
    else:
        tips.append(f"more GPUs than {s.world_size}, or CPU offload with more host RAM (--host-memory)")
    alt = Alternative(s, False, need, f"needs {fmt_gib(need)} at micro-batch 1; budget {fmt_gib(search.budget)}")
    return Plan(setup=None, estimate=None, evaluated=search.evaluated, smallest=alt, suggestions=tuple(tips), **common)


def _largest_seq_len(search: _Search, s: Setup) -> int:
    """Largest seq_len below the current one at which `s` fits at micro-batch 1 (0 if none >= 16)."""
    def fits_at(n: int) -> bool:
        try:
            return fits(search.estimate(dataclasses.replace(s, seq_len=n)), search.budget)
        except MemplanError:
            return False

    lo, hi = 16, s.seq_len  # invariant once checked: lo fits, hi does not
    if not fits_at(lo):
        return 0
    while hi - lo > 16:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo // 16 * 16 if lo >= 32 else lo
