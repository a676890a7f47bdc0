"""Figures for the HTML reports (doctor, bench): matplotlib without a display, embedded as PNG data URIs so a report
is one self-contained file."""

from __future__ import annotations

import base64
import io


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported when a figure is drawn: it costs a second at import)."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, and the same output everywhere
    import matplotlib.pyplot as plt

    return plt


def png_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


__all__ = ["pyplot", "png_data_uri"]
