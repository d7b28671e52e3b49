"""User-facing errors: the CLI prints their message (which names the file, row and fix) and exits 2."""


class MmtokError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""



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
