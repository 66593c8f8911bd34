"""The GPU check's one table: rows, the printed text form and the markdown form (docs/gpu-results.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.gpu.arith import FAIL, PASS, SKIP

COLUMNS = ("section", "case", "result", "measured", "reference", "note")


@dataclass(frozen=True)
class Row:
    section: str
    case: str
    result: str  # PASS, FAIL, SKIP or INFO
    measured: str = ""
    reference: str = ""
    note: str = ""

    def cells(self) -> tuple[str, ...]:
        return (self.section, self.case, self.result, self.measured, self.reference, self.note)


def counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows of each result."""
    out: dict[str, int] = {}
    for row in rows:
        out[row.result] = out.get(row.result, 0) + 1
    return out


def exit_code(rows: Sequence[Row]) -> int:
    """0 when no row failed, 1 otherwise."""
    return 1 if any(row.result == FAIL for row in rows) else 0


def summary(rows: Sequence[Row]) -> str:
    tally = counts(rows)
    parts = [f"{tally.get(key, 0)} {key}" for key in (PASS, FAIL, SKIP)]
    if tally.get("INFO"):
        parts.append(f"{tally['INFO']} INFO")
    return ", ".join(parts)


def format_text(rows: Sequence[Row]) -> str:
    """A fixed-width table for the terminal: each column as wide as its widest cell."""
    table = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    out = []
    for n, line in enumerate(table):
        out.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def format_markdown(rows: Sequence[Row], header: Mapping[str, str], title: str = "GPU check") -> str:
    """The table as markdown, after a list of what it ran on (device, versions, date, command)."""
    lines = [f"# {title}", ""]
    lines += [f"- **{key}**: {_md(value)}" for key, value in header.items()]
    lines += ["", f"Result: {summary(rows)}.", "", "| " + " | ".join(COLUMNS) + " |",
              "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    lines += ["| " + " | ".join(_md(cell) for cell in row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def last_line(text: str, limit: int = 160) -> str:
    """The line of a log that says what went wrong: the last ``SomethingError: ...`` line, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "no output"
    errors = [line for line in lines if ("Error" in line.split(":")[0] or "Exception" in line.split(":")[0])
              and ":" in line]
    chosen = errors[-1] if errors else lines[-1]
    return chosen if len(chosen) <= limit else chosen[:limit - 1] + "…"
