"""The one rule for showing untrusted text to a person (a log line, the CLI's human output):
nothing it contains may start a line, move the cursor, recolour or hide text, or reorder
what follows. Ids, reasons, objectives, errors and a message's own words are shown through
`escape`; what they say stays readable (`\\n`, `\\x1b`, `\\u2028`), letters of any script
and emoji stay as they are.
"""

import re

# C0 controls (newline, CR, tab, ESC, NUL ...), DEL and C1 controls (a lone \x9b is a CSI
# to some terminals, \x85 a line break to some readers); the Unicode line and paragraph
# separators; the bidi embeddings, overrides and isolates, which reorder the text after
# them; and lone surrogates, which a UTF-8 stream cannot write at all.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape(value: object) -> str:
    """`value` as text on one line with no control character in it. Idempotent (the escapes
    are printable ASCII), so text escaped twice reads the same. A backslash is kept as it
    is: escaping it too would double every backslash of a path or a regex in an error."""
    return UNSAFE.sub(_escaped, value if isinstance(value, str) else str(value))
