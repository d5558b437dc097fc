"""The one escaping rule for untrusted text shown to a person (workflows/escape.py)."""

import pytest

from agent_radar.workflows.escape import escape


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("x\nCRITICAL forged", "x\\nCRITICAL forged"),
        ("a\rb", "a\\rb"),
        ("a\tb", "a\\tb"),
        ("\x1b[8mhidden", "\\x1b[8mhidden"),
        ("nul\x00", "nul\\x00"),
        ("del\x7f", "del\\x7f"),
        ("csi\x9b31m", "csi\\x9b31m"),
        ("next\x85line", "next\\x85line"),
        ("line\u2028sep", "line\\u2028sep"),
        ("para\u2029sep", "para\\u2029sep"),
        ("\u202eevil", "\\u202eevil"),
        ("\u2066isolate\u2069", "\\u2066isolate\\u2069"),
        ("lone \ud800", "lone \\ud800"),
    ],
)
def test_controls_separators_and_bidi_overrides_are_escaped(raw, shown):
    assert escape(raw) == shown
    assert escape(shown) == shown  # idempotent: escaping twice reads the same
    assert shown.isascii() and shown.isprintable()


@pytest.mark.parametrize(
    "text",
    ["ship the release", "déjà vu: é, ß, Ω, 日本語", "party 🎉 time", "C:\\path\\n", "", "a  b"],
)
def test_normal_text_and_letters_of_any_script_are_untouched(text):
    assert escape(text) == text


def test_non_strings_are_shown_as_text():
    assert escape(7) == "7" and escape(None) == "None"
