"""The catalog against the model cards: every entry's exact parameter count (the real transformers class built on
the meta device, memplan refresh-catalog) beside the count its model card publishes (SOURCES.md "published").

    python benchmarks/catalog_check.py        # writes benchmarks/results/catalog_check.md; exit 1 on a miss

A published figure is one of:
- `card 7.61B; <where>`: the card (or paper, official blog) states a count. It must agree within 1% plus half a
  unit of its last stated digit ("7.61B" stands for 7.605-7.615B), with the total or with the total less an untied
  output head (cards such as phi-1.5's count the transformer without it; the row says which matched).
- `name 8B; <where>`, or a card figure with fewer than three significant digits ("110M", "~2.8B": a size class,
  not a count): only the model's name gives a size: reported, never a miss (names round freely and often
  leave out embeddings: OLMo-2-0425-1B holds 1.48B); those more than 15% away are listed.
- `none`: nothing published: reported only.
Rows written before this format (free text such as `model card "355M"`) count as `card` when the figure has three
significant digits or more ("8.03B") and as `name` otherwise ("1.5B" for gpt2-xl's 1.56B).
"""
from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memplan.fileio import write_text_atomic  # noqa: E402
from memplan.model.catalog import catalog_index  # noqa: E402

UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
CARD_TOLERANCE = 0.01
NAME_TOLERANCE = 0.15
_FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(K|M|B|T|billion|million)?\b", re.IGNORECASE)


def parse_published(text: str) -> tuple[str, float | None, float]:
    """(kind, count, rounding) of a SOURCES.md "published" cell; kind is card, name or none; rounding is half a
    unit of the figure's last stated digit, relative to the figure."""
    text = (text or "").strip()
    kind = next((k for k in ("card", "name", "none") if text.lower().startswith(k)), "")
    if kind == "none" or not text:
        return "none", None, 0.0
    body = text.split(";", 1)[0] if kind else text
    figures = []
    for m in _FIGURE.finditer(body):
        digits, unit = m.group(1).replace(",", ""), (m.group(2) or "").upper()
        unit = {"BILLION": "B", "MILLION": "M"}.get(unit, unit)
        if not unit and "," not in m.group(1):
            continue  # a bare number such as a year or a version, not a count
        value = float(digits) * UNITS.get(unit, 1)
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        half_unit = 0.5 * 10 ** -decimals * UNITS.get(unit, 1) if unit else 0.5
        mantissa = digits.replace(".", "").lstrip("0") if "." in digits else digits.strip("0")
        figures.append((half_unit / value, value, len(mantissa) >= 3))
    if not figures:
        return "none", None, 0.0
    rounding, value, precise = figures[0] if kind else min(figures)  # an old row: its most precise figure
    if kind == "card" and not precise:
        return "rounded", value, rounding
    return kind or ("card" if precise else "name"), value, rounding


def head_params(model_id: str) -> int:
    """Parameters of the untied output head (role lm_head), which some cards leave out of their count."""
    from memplan.model.catalog import load_spec

    return sum(p.numel for p in load_spec(model_id).params if p.role == "lm_head")


def check(index: dict) -> list[dict]:
    rows = []
    for model_id, row in sorted(index.items(), key=lambda kv: kv[0].lower()):
        kind, published, rounding = parse_published(row.get("published", ""))
        computed = row["params_total"]
        tol = CARD_TOLERANCE + rounding if kind == "card" else NAME_TOLERANCE
        err, basis = ((computed - published) / published, "total") if published else (None, "")
        if kind == "card" and abs(err) > tol:
            head = head_params(model_id)
            alt = (computed - head - published) / published
            if head and abs(alt) <= tol:
                err, basis = alt, "without the output head"
        ok = None if err is None or kind != "card" else abs(err) <= tol
        rows.append(dict(model=model_id, variant_of=row.get("variant_of", ""), computed=computed, kind=kind,
                         published=published, error=err, tolerance=tol, ok=ok, basis=basis,
                         far=kind in ("name", "rounded") and err is not None and abs(err) > NAME_TOLERANCE,
                         source=row.get("published", "")))
    return rows


def markdown(rows: list[dict]) -> str:
    cards = [r for r in rows if r["kind"] == "card"]
    names = [r for r in rows if r["kind"] in ("name", "rounded")]
    misses = [r for r in rows if r["ok"] is False]
    variants = sum(bool(r["variant_of"]) for r in rows)
    lines = [
        "# Catalog parameter counts vs model cards",
        "",
        f"Written by benchmarks/catalog_check.py on {datetime.date.today()}: {len(rows)} catalog entries "
        f"({len(rows) - variants} configs, {variants} variants answered from a base config).",
        "",
        f"- card figures: {len(cards)}; within 1% plus the stated rounding: {sum(bool(r['ok']) for r in cards)} "
        f"({sum(r['basis'] == 'without the output head' for r in cards)} of them as the card counts, without the "
        f"untied output head)",
        f"- sizes from the model name or a rounded statement (\"110M\", \"~2.8B\": fewer than 3 significant "
        f"digits): {len(names)}; more than {NAME_TOLERANCE:.0%} away (names round freely and often leave out "
        f"embeddings): {', '.join(r['model'] for r in names if r['far']) or 'none'}",
        f"- nothing published: {sum(r['kind'] == 'none' for r in rows)}",
        f"- misses: {len(misses)}" + ("".join(f"\n  - {r['model']}: computed {r['computed']:,}, published "
                                              f"{r['published']:,.0f} ({r['error']:+.1%})" for r in misses)),
        "",
        "| model | variant of | computed (meta device) | published | kind | error | ok |",
        "|---|---|---:|---|---|---:|---|",
    ]
    for r in rows:
        pub = r["source"].replace("|", "/")[:140] if r["source"] else "-"
        err = f"{r['error']:+.2%}" if r["error"] is not None else "-"
        err += " (without head)" if r["basis"] == "without the output head" else ""
        ok = {True: "yes", False: "**no**", None: "-"}[r["ok"]]
        lines.append(f"| {r['model']} | {r['variant_of'] or '-'} | {r['computed']:,} | {pub} | {r['kind']} | {err} "
                     f"| {ok} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    rows = check(catalog_index())
    out = ROOT / "benchmarks" / "results" / "catalog_check.md"
    write_text_atomic(out, markdown(rows))
    misses = [r for r in rows if r["ok"] is False]
    print(f"{len(rows)} entries, {sum(r['kind'] == 'card' for r in rows)} with a card figure, {len(misses)} misses; "
          f"wrote {out.relative_to(ROOT)}")
    print(json.dumps([r["model"] for r in misses]))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
