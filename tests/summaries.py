"""What the tests read of a command's printed summary: one shape on stderr, stdout left to data."""

from __future__ import annotations

import json


def summary_lines(captured, command: str) -> list[str]:
    """The summary lines of a run without --json (progress off): stdout empty, stderr `mmtok COMMAND: ...`
    lines, each followed by its indented detail lines."""
    assert captured.out == "", f"`mmtok {command}` printed on stdout: {captured.out[:500]!r}"
    lines = captured.err.splitlines()
    assert lines and lines[0].startswith(f"mmtok {command}: "), captured.err[:500]
    assert all(line.startswith((f"mmtok {command}: ", "  ")) for line in lines), captured.err[:2000]
    return lines


def json_result(captured) -> dict:
    """The one JSON object a --json run prints on stdout."""
    [line] = captured.out.splitlines()
    result = json.loads(line)
    assert isinstance(result, dict)
    return result
