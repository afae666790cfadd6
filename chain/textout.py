"""CLI output that a pipe or a capture gets whole.

Rich fits tables to the console, and a console that is not a terminal is 80 columns wide unless
$COLUMNS says otherwise: piped into grep or captured by a script, `deltaswarm chain ls` came out
as `v00000…` and `46,151…` (issue 22). Off a terminal, tables here are plain rows padded to
their longest cell, and a rich console is made wide enough never to cut or wrap a line.
"""

from collections.abc import Container, Sequence
from typing import TextIO

from rich.console import Console
from rich.table import Table

UNCUT_WIDTH = 10_000
"""Width of a console that is not a terminal: tables keep their natural width (they do not
expand to fill it), and no line a CLI here prints comes near it."""


def console(file: TextIO | None = None) -> Console:
    """A rich console: as usual on a terminal, otherwise one that never cuts or wraps."""
    probe = Console(file=file)
    if probe.is_terminal:
        return probe
    return Console(file=file, width=UNCUT_WIDTH, soft_wrap=True)


def print_table(out: Console, headers: Sequence[str], rows: Sequence[Sequence[str]],
                right: Container[str] = ()) -> None:
    """`rows` under `headers` (`right`: the headers of right-aligned columns). On a terminal, a
    rich table whose cells fold rather than end in an ellipsis (the first column never
    breaks); otherwise plain text, columns two spaces apart, every cell whole, one line per
    row, so `awk` and `grep` read it."""
    if out.is_terminal:
        t = Table()
        for i, h in enumerate(headers):  # the first column names the row: never split
            t.add_column(h, justify="right" if h in right else "left", overflow="fold",
                         no_wrap=i == 0)
        for r in rows:
            t.add_row(*r)
        out.print(t)
        return
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=False)]
    for r in (headers, *rows):
        cells = [str(c).rjust(w) if h in right else str(c).ljust(w)
                 for h, c, w in zip(headers, r, widths, strict=True)]
        out.file.write("  ".join(cells).rstrip() + "\n")
