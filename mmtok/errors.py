"""User-facing errors: the CLI prints their message (which names the file, row and fix) and exits 2."""


class MmtokError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""


class DamagedFile(MmtokError, ValueError):
    """A file mmtok reads back (one a stage wrote, or one a user supplied) that does not hold what it must:
    its message is one line naming the file (and the key); a ValueError too, so the readers that report an
    unreadable file and go on (`mmtok status`) treat it like a file that does not parse."""



BRIEF_LIMIT = 200


def brief(text: object, limit: int = BRIEF_LIMIT) -> str:
    """`str(text)` on one line and at most about `limit` characters, its middle elided: for quoting what a
    library or a file said in a message (a parser's error may quote megabytes of the file it read)."""
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    keep = limit // 2
    return f"{line[:keep]} … ({len(line) - 2 * keep:,} characters) … {line[-keep:]}"


class Skip(Exception):
    """An input that does not become tokens: a counted `reason` (snake_case) and a `detail` for people.

    `str(skip)` is "reason: detail"; `Skip.parse` reads that form back (reasons never contain ": ").
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    @classmethod
    def parse(cls, text: str) -> "Skip":
        reason, _, detail = text.partition(": ")
        return cls(reason, detail)
