"""docs/team-server.md's runnable blocks, which the team fixtures and tests run as written."""

from __future__ import annotations

import re

from tests.helpers.project import REPO

GUIDE = REPO / "docs" / "team-server.md"
_BLOCK = re.compile(r"<!-- run: ([\w-]+)[^>]*-->\n```bash\n(.*?)```", re.S)


def guide_blocks() -> dict[str, str]:
    """The guide's runnable bash blocks by name (a block marked ``run: no`` is left out)."""
    return {name: body for name, body in _BLOCK.findall(GUIDE.read_text(encoding="utf-8")) if name != "no"}
