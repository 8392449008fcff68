"""Tracking URIs without their secrets, for every message that names one.

``--tracking-uri``/``MLFLOW_TRACKING_URI`` may carry credentials (``https://user:PASSWORD@host``,
``postgresql://user:PASSWORD@db/mlflow``, ``https://TOKEN@host``, ``...?token=...``), and
rlaudit names the URI in what it prints (stderr, often a CI log that others read). Messages use
:func:`mask_uri` for the URI itself and :func:`redact` for text that may quote it (an error from
MLflow or from the network stack).
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"
#: query parameters whose values are credentials
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|auth|cred|sig", re.IGNORECASE)
#: shorter secrets are not searched for in free text (they would mangle unrelated words)
_MIN_SECRET_LEN = 4


def _split(uri: str):
    try:
        return urllib.parse.urlsplit(uri)
    except ValueError:
        return None


def secrets_in(uri: str) -> list[str]:
    """The credentials ``uri`` carries: a userinfo password (or a lone user, often a token),
    and the values of credential-like query parameters."""
    parts = _split(uri)
    if parts is None:
        return []
    out = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        out.append(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_PARAM.search(name) and value:
            out.append(value)
    return [s for s in out if s]


def mask_uri(uri: str) -> str:
    """``uri`` with its password (or lone user / token) and credential parameters masked."""
    parts = _split(uri)
    if parts is None or not secrets_in(uri):
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = (f"{userinfo.split(':', 1)[0]}:{MASK}@{host}" if ":" in userinfo
                  else f"{MASK}@{host}")
    query = "&".join(
        f"{urllib.parse.quote(k)}={MASK if _SECRET_PARAM.search(k) and v else urllib.parse.quote(v)}"
        for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str, uri: str | None) -> str:
    """``text`` with ``uri`` masked wherever it appears, and its secrets (plain or
    percent-decoded) replaced by ``***``."""
    if not uri:
        return text
    text = text.replace(uri, mask_uri(uri))
    for secret in secrets_in(uri):
        for form in {secret, urllib.parse.unquote(secret)}:
            if len(form) >= _MIN_SECRET_LEN:
                text = text.replace(form, MASK)
    return text
