"""Render a terminal capture (`tmux capture-pane -p > pane.txt`) to a PNG, as docs/watch-terminal.png was made:

python scripts/render_terminal.py pane.txt docs/watch-terminal.png
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

FG, BG, ALERT = "#d0d0d0", "#1e1e1e", "#ff6b6b"


def render(text: str, out: str) -> None:
    lines = text.rstrip("\n").splitlines() or [""]
    width = max(len(line) for line in lines)
    char_w, line_h = 0.0825, 0.19  # inches per character and per line at 10 pt DejaVu Sans Mono
    fig = plt.figure(figsize=(width * char_w + 0.4, len(lines) * line_h + 0.4), facecolor=BG)
    for i, line in enumerate(lines):
        colour = ALERT if ("ALERT" in line or "LOW" in line) else FG
        fig.text(0.2 / fig.get_figwidth(), 1 - (0.2 + (i + 0.8) * line_h) / fig.get_figheight(), line,
                 family="DejaVu Sans Mono", size=10, color=colour)  # fmt: skip
    fig.savefig(out, dpi=110, facecolor=BG)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: render_terminal.py PANE.txt OUT.png")
    with open(sys.argv[1], encoding="utf-8") as f:
        render(f.read(), sys.argv[2])
