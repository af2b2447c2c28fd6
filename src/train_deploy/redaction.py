"""Credentials out of what is shown: a URI's ``user:password@`` never reaches a log line, an error or a response.

Ground floor (imports nothing of the project): training's metrics forwarder and launcher, the registry's retries
and command line, the preflight checks and the server all show tracking URIs through :func:`redact_uri`.
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact_uri(text: str) -> str:
    """``text`` (a URI, or a message holding URIs) without the ``user:password@`` of its URIs."""
    return _USERINFO.sub("", text)
