"""The catalog against the model cards: every entry's exact parameter count (the real transformers class built on
the meta device, memplan refresh-catalog) beside the count its model card publishes (SOURCES.md "published").

    python benchmarks/catalog_check.py        # writes benchmarks/results/catalog_check.md; exit 1 on a miss

A published figure is one of:
- `card 7.61B; <where>`: the card (or paper, official blog) states a count. It must agree within 1%, or within
  half a unit of its last stated digit where that is wider ("0.5B" stands for 0.45-0.55B).
- `name 8B; <where>`: only the model's name gives a size: reported, checked within 15% (names round freely:
  Llama-3.1-8B has 8.03B, gemma-7b 8.54B with its embedding).
- `none`: nothing published: reported only.
Rows written before this format (free text such as `model card "355M"`) count as `card` when the figure has a
decimal point and as `name` otherwise.
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
        figures.append((half_unit / value, value, "." in digits or not unit))
    if not figures:
        return "none", None, 0.0
    rounding, value, precise = figures[0] if kind else min(figures)  # an old row: its most precise figure
    return kind or ("card" if precise else "name"), value, rounding


def check(index: dict) -> list[dict]:
    rows = []
    for model_id, row in sorted(index.items(), key=lambda kv: kv[0].lower()):
        kind, published, rounding = parse_published(row.get("published", ""))
        computed = row["params_total"]
        err = (computed - published) / published if published else None
        tol = max(CARD_TOLERANCE, rounding) if kind == "card" else NAME_TOLERANCE
        ok = None if err is None else abs(err) <= tol
        rows.append(dict(model=model_id, variant_of=row.get("variant_of", ""), computed=computed, kind=kind,
                         published=published, error=err, tolerance=tol, ok=ok,
                         source=row.get("published", "")))
    return rows


def markdown(rows: list[dict]) -> str:
    cards = [r for r in rows if r["kind"] == "card"]
    names = [r for r in rows if r["kind"] == "name"]
    misses = [r for r in rows if r["ok"] is False]
    variants = sum(bool(r["variant_of"]) for r in rows)
    lines = [
        "# Catalog parameter counts vs model cards",
        "",
        f"Written by benchmarks/catalog_check.py on {datetime.date.today()}: {len(rows)} catalog entries "
        f"({len(rows) - variants} configs, {variants} variants answered from a base config).",
        "",
        f"- card figures: {len(cards)}; within tolerance (1% or the stated rounding): "
        f"{sum(bool(r['ok']) for r in cards)}",
        f"- sizes from the model name only: {len(names)}; within {NAME_TOLERANCE:.0%}: "
        f"{sum(bool(r['ok']) for r in names)}",
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
