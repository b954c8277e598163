"""Which script a text is written in, as far as the service cares: Han or not.

One split for everything that differs by language: fusion settings and quality calibrations
(queries), and the Latin-script dense leg (queries and chunks: README "The Latin-script dense
leg")."""

from __future__ import annotations

import re

# Han ideographs (incl. extension A and compatibility), as a character-class body for
# patterns that build on it, and as a one-character pattern.
HAN_CHARS = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
HAN = re.compile(f"[{HAN_CHARS}]")


def has_han(text: str) -> bool:
    """The text has Han characters: it is treated as Chinese."""
    return HAN.search(text) is not None
