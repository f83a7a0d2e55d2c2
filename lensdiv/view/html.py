"""HTML building blocks shared by the prompt view and the report: the template environment,
colours for probabilities, figures as inline images, visible token strings."""

from __future__ import annotations

import base64
import io
import math
from functools import cache
from typing import Any

# Matplotlib's "Blues" colour map at nine points (0 → 1): light for unlikely, dark for likely.
# Written out so an HTML page or a terminal needs no matplotlib to colour a probability.
_BLUES = (
    (247, 251, 255),
    (222, 235, 247),
    (198, 219, 239),
    (158, 202, 225),
    (107, 174, 214),
    (66, 146, 198),
    (33, 113, 181),
    (8, 81, 156),
    (8, 48, 107),
)
PROB_CMAP = "Blues"


def prob_colour(p: float) -> tuple[str, str]:
    """``(background, text)`` hex colours for a probability ``p`` in ``[0, 1]``."""
    if not math.isfinite(p):
        return "#ffffff", "#000000"
    x = min(max(p, 0.0), 1.0) * (len(_BLUES) - 1)
    i = min(int(x), len(_BLUES) - 2)
    t = x - i
    rgb = [round(a + (b - a) * t) for a, b in zip(_BLUES[i], _BLUES[i + 1], strict=True)]
    luminance = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
    return "#{:02x}{:02x}{:02x}".format(*rgb), "#000000" if luminance > 140 else "#ffffff"


def visible(token: str, limit: int = 12) -> str:
    """A token as a label: spaces and line breaks made visible, long tokens cut with "…"."""
    text = token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    text = "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c for c in text)
    if not text:
        return "∅"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def figure_data_uri(fig: Any) -> str:
    """A matplotlib figure as an inline ``data:image/png;base64,...`` URI."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@cache
def environment() -> Any:
    """The Jinja2 environment of lensdiv's templates (autoescaped HTML)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("lensdiv.view", "templates"),
        autoescape=jinja2.select_autoescape(("html", "j2")),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["visible"] = visible
    env.filters["fmt"] = fmt
    env.filters["percent"] = percent
    return env


def render(template: str, **context: Any) -> str:
    """Render one of lensdiv's templates."""
    text: str = environment().get_template(template).render(**context)
    return text


def fmt(value: Any) -> str:
    """A table cell: floats to 4 significant digits, NaN as blank-looking "–"."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        return f"{value:.4g}"
    return str(value)


def percent(p: float) -> str:
    """A probability as a short percentage: ``62%``, ``0.4%``, ``<0.1%``."""
    if not math.isfinite(p):
        return "–"
    if p >= 0.995:
        return f"{p:.0%}"
    if p >= 0.1:
        return f"{p * 100:.0f}%"
    if p >= 0.001:
        return f"{p * 100:.1f}%"
    return "<0.1%"
