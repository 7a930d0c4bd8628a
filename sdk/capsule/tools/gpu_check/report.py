"""gpu_check.md: one section per step, its figures as markdown tables (the bench's table format).

Scalars and small nested dicts become one `figure | value` table (nested keys dotted); lists
of rows become their own table; a failed step's error and output tail follow as code blocks.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..bench.report import format_table

TEXT_KEYS = ("error", "output_tail", "traceback")   # long text: code blocks, not table cells
HEADING_KEYS = ("ok", "seconds", "timeout_s")        # said in the step's heading
TAIL_CHARS = 1500


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and not any(isinstance(v, (dict, list)) for v in value):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict) and not any(isinstance(v, (dict, list)) for v in value.values()):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items()) or "-"
    return value


def _split(fig: Mapping[str, Any], prefix: str = "") -> tuple[list[dict[str, Any]], dict[str, list]]:
    """(figure rows, titled row lists) of a step's figures, nested dicts flattened one level."""
    rows: list[dict[str, Any]] = []
    tables: dict[str, list] = {}
    for k, v in fig.items():
        key = f"{prefix}{k}"
        if k in TEXT_KEYS + HEADING_KEYS and not prefix:
            continue
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            tables[key] = v
        elif isinstance(v, dict) and any(isinstance(x, (dict, list)) for x in v.values()):
            sub_rows, sub_tables = _split(v, f"{key}.")
            rows += sub_rows
            tables.update(sub_tables)
        elif isinstance(v, dict) and len(v) <= 6:
            rows += [{"figure": f"{key}.{a}", "value": _cell(b)} for a, b in v.items()]
        else:
            rows.append({"figure": key, "value": _cell(v)})
    return rows, tables


def _uniform(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with every key any row has (format_table takes the first row's keys)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: _cell(r.get(k)) for k in keys} for r in rows]


def markdown(doc: Mapping[str, Any], what: Mapping[str, str]) -> str:
    """The whole report; `what` gives each step's one-line description."""
    steps = doc["steps"]
    ok = sum(1 for s in steps.values() if s.get("ok"))
    md = [f"# GPU check ({doc['device']}{', quick' if doc.get('quick') else ''})", "",
          f"{ok} of {len(steps)} steps ok in {doc['total_s']:.1f} s (step limits sum to "
          f"{doc['timeout_sum_s']} s). Created {doc['created']}.", "",
          format_table([{"step": n, "ok": "ok" if s.get("ok") else "FAILED", "seconds": s.get("seconds"),
                         "limit_s": s.get("timeout_s"), "error": (s.get("error") or "")[:120]}
                        for n, s in steps.items()], markdown=True)]
    for name, fig in steps.items():
        state = "ok" if fig.get("ok") else "FAILED"
        md += ["", f"## {name}: {state} ({fig.get('seconds', 0):.1f} s of {fig.get('timeout_s')} s)", "",
               what.get(name, ""), ""]
        rows, tables = _split(fig)
        md.append(format_table(rows, markdown=True))
        for title, table in tables.items():
            md += ["", f"{title}:", "", format_table(_uniform(table), markdown=True)]
        for key in TEXT_KEYS[:2]:
            if fig.get(key) and not fig.get("ok"):
                md += ["", f"{key}:", "", "```", str(fig[key])[-TAIL_CHARS:].strip(), "```"]
    return "\n".join(md) + "\n"
