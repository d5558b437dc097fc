"""Signed reports (docs/protocol.md: reports): a report is the word of one agent host only when it
carries an HMAC of its canonical body made with that host's token. Hosts in any language sign the
same bytes: the report without `signature`, as JSON with its keys sorted at every level, no
whitespace, and every character outside ASCII escaped (`\\uXXXX`, as Python's `json.dumps` and
JavaScript's canonical forms in docs/protocol.md write it).

`signed_by` names the signing host; `occurred_at_ms`, inside the signed body, bounds a replay:
a signed report older than MAX_SIGNED_AGE_S is refused.
"""

import hashlib
import hmac
import json
from typing import Any

# How old a signed report may be when it is applied: a replay of an older one is refused
# (a report is a hint; what it would have told, the host's state answer tells).
MAX_SIGNED_AGE_S = 600
SIGNATURE_HEX_CHARS = 64


def canonical(report: dict[str, Any]) -> bytes:
    """The bytes a report's signature covers: the report without `signature`."""
    body = {key: value for key, value in report.items() if key != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature_of(report: dict[str, Any], token: str) -> str:
    """The hex HMAC-SHA256 of the report's canonical body under the host's token."""
    return hmac.new(token.encode(), canonical(report), hashlib.sha256).hexdigest()


def sign(report: dict[str, Any], host_id: str, token: str) -> dict[str, Any]:
    """The report as `host_id` signs it with its token."""
    signed = {key: value for key, value in report.items() if key != "signature"}
    signed["signed_by"] = host_id
    signed["signature"] = signature_of(signed, token)
    return signed


def signature_ok(report: dict[str, Any], token: str) -> bool:
    """Whether the report's signature is the host's, for that token (compared in constant
    time)."""
    given = report.get("signature")
    return isinstance(given, str) and hmac.compare_digest(given, signature_of(report, token))
