"""Credentials out of everything polytrain writes, logs or prints: the user-info of a URI
(``postgresql://user:PASSWORD@host/db``, ``s3://KEY:SECRET@bucket/x``, ``https://TOKEN@host``) and the values of
query parameters whose names say they hold one (``?password=``, ``?token=``, ``?X-Amz-Signature=``).

``redact_text`` rewrites every such URI in a string, also one inside a longer message; ``redacted`` does it to every
string of plain data (the spec as a manifest, ``model.json``, a tracker's params or an error holds it). A password
becomes ``***``, the user name before it stays (``postgresql://user:***@host/db``: still says which account); a
user-info without a password is often a token (``https://TOKEN@github.com``) and becomes ``***`` whole. The text
stays a URI of the same shape, so a reader sees where it pointed.

Only what is shown is redacted: the spec a run uses keeps the real value, so that MLflow, W&B or a data reader get
it in-process (never on a command line or in a file polytrain writes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# a scheme, "://", then the rest of the token (up to white space or a quote)
_URI = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>`]+)")
# query parameters whose value is a credential (matched in the lower-cased name)
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|sig|auth|credential|session", re.IGNORECASE)
_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#?]+)=(?P<value>[^&;#]*)")


def _user_info_end(rest: str) -> int:
    """Where the user-info of ``rest`` (what follows ``scheme://``) ends (its ``@``), or -1 when it has none: the
    last ``@`` before the first ``/``, ``?`` or ``#`` (a password with an unescaped ``@`` is masked whole); when
    there is none but a ``:`` comes before that character, the last ``@`` of the token (a password with an
    unescaped ``/``: masked whole, although ``http://host:8080/a@b`` then loses its host too). An ``@`` in a path
    (``s3://bucket/dir/@file``) is left alone."""
    head = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in head:
        return head.rfind("@")
    return rest.rfind("@") if ":" in head else -1


def _without_user_info(rest: str) -> str:
    """``rest`` (what follows ``scheme://``) with its user-info masked."""
    at = _user_info_end(rest)
    if at < 0:
        return rest
    info, tail = rest[:at], rest[at:]
    user, colon, _ = info.partition(":")
    if colon and "/" not in user and "@" not in user:
        return f"{user}:{MASK}{tail}"
    return f"{MASK}{tail}"


def _without_secret_params(rest: str) -> str:
    def mask(match: re.Match[str]) -> str:
        if not _SECRET_PARAM.search(match["name"]) or not match["value"]:
            return match[0]
        return f"{match['sep']}{match['name']}={MASK}"

    query = rest.find("?")
    return rest if query < 0 else rest[:query] + _PARAM.sub(mask, rest[query:])


def redact_text(text: str) -> str:
    """``text`` with the credentials of every URI in it masked (see the module's docstring)."""
    if "://" not in text:
        return text
    return _URI.sub(lambda m: m["scheme"] + _without_secret_params(_without_user_info(m["rest"])), text)


def without_user_info(uri: str) -> str:
    """``uri`` without its user-info (``file://user:pw@localhost/x`` -> ``file://localhost/x``): for a store where a
    credential means nothing (a local directory), so that it is not written into the store either."""
    match = _URI.match(uri.strip())
    if match is None:
        return uri
    at = _user_info_end(match["rest"])
    return uri if at < 0 else match["scheme"] + match["rest"][at + 1:]


def redacted(value: Any) -> Any:
    """``value`` with `redact_text` applied to every string in it (keys too), through mappings, lists and tuples
    (which stay tuples); anything else is returned as it is."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {redacted(key): redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [redacted(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def holds_secret(value: Any) -> bool:
    """Whether `redacted` would change ``value``."""
    return redacted(value) != value
