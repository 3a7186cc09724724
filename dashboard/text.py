"""User text (run names, notes, URL values) shown inside Markdown must stay plain text."""

from __future__ import annotations

import re

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~:$&])")


def md_escape(text: str) -> str:
    """Backslash-escape everything Streamlit's Markdown would interpret: emphasis, links, images,
    HTML-like tags, `:color[…]` directives, emoji shortcodes and LaTeX."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)
