"""What people look at: the prompt view and the self-contained HTML report of a run.

Both are made of results and plain data alone (no model), so a saved run renders anywhere.
Pages are written with Jinja2 templates (autoescaped: token strings are never markup) and are
self-contained: styles inline, plots as inline PNG, no script or font from the network.
"""

from __future__ import annotations

from lensdiv.view.prompt import PromptView as PromptView
from lensdiv.view.report import report_html as report_html

__all__ = ["PromptView", "report_html"]
