"""Showing a storage URL without its secrets (FAILURES F23).

Every place that shows a store - ``repr``, ``describe()``, errors, log lines, the
``simulate`` summary and its JSON - shows :func:`redact` of its URL: the password of
the userinfo (``redis://user:PW@host``) and the value of every secret-looking query
parameter (``?password=PW``) become ``***``. The URL handed to the client keeps them.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

__all__ = ["SECRET_PARAMS", "redact", "scrub", "secrets"]

#: Query parameters whose value is a secret (compared lower-cased).
SECRET_PARAMS = frozenset(
    {"password", "passwd", "pwd", "pass", "secret", "token", "auth", "api_key", "apikey", "access_key",
     "secret_key", "access_token", "sas", "sig", "signature", "credential", "credentials"}
)  # fmt: skip
_MASK = "***"
#: One ``name=value`` of a query (``&`` or ``;`` separated); the value may be empty.
_PARAM = re.compile(r"(?P<name>[^&;=]*)(?P<eq>=?)(?P<value>[^&;]*)")


def redact(text: str) -> str:
    """``text`` with the password of a URL's userinfo and the values of its secret query
    parameters replaced by ``***``. Text that is not a URL comes back unchanged; a URL
    that does not parse is cut to its scheme (nothing else of it is shown).

    The userinfo is everything up to the last ``@``, so a password holding ``/``, ``?``
    or ``#`` unencoded is still masked (a ``@`` later in the URL masks more, not less).
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}{colon}{_MASK if colon else ''}@{rest}"
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError:  # a malformed URL (an unclosed IPv6 bracket)
        return f"{scheme}://{_MASK}"
    if not parts.query and not parts.fragment:
        return f"{scheme}://{rest}"
    query = _PARAM.sub(_redact_param, parts.query)
    return urlunsplit(parts._replace(query=query, fragment=_MASK if parts.fragment else ""))


def secrets(url: str) -> list[str]:
    """The secrets ``url`` carries (userinfo password, secret query values), as written
    and percent-decoded, longest first: what :func:`scrub` takes out of other text."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    if not sep:
        return []
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        found.add(userinfo.partition(":")[2])
    query = rest.partition("?")[2]
    for m in _PARAM.finditer(query):
        if m.group("eq") and m.group("name").lower() in SECRET_PARAMS:
            found.add(m.group("value").partition("#")[0])
    found |= {unquote(s) for s in found} | {unquote_plus(s) for s in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, say, that may quote ``url`` or a part of it) with every
    secret of ``url`` replaced by ``***``."""
    found = secrets(url)
    if not found:
        return text
    return re.sub("|".join(map(re.escape, found)), _MASK, text)  # one left-to-right pass


def _redact_param(m: re.Match[str]) -> str:
    name = m.group("name")
    if m.group("eq") and name.lower() in SECRET_PARAMS:
        return f"{name}={_MASK}"
    return m.group(0)
