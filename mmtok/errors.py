"""User-facing errors: the CLI prints their message (which names the file, row and fix) and exits 2."""


class MmtokError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""


class NotImplementedYet(MmtokError):
    def __init__(self, command: str):
        super().__init__(f"`mmtok {command}` is not implemented yet")
