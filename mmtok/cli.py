"""Command-line entry point: argument parsing only; each command lives in mmtok/commands/<name>.py.

Every command module provides `add_parser(subparsers)`, which registers its parser and sets
`func` to a `run(args) -> int` function. Heavy imports (torch, pyarrow) happen inside `run`,
so `mmtok --help` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import select
import sys

from mmtok import __version__
from mmtok.errors import MmtokError

COMMANDS = ("scan", "hash", "dedup", "plan", "calibrate", "encode", "pack", "sft", "merge", "audio", "bench", "inspect",
            "codec", "demo", "tokenizer", "status")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmtok",
        description="Turn image and audio corpora into discrete tokens for Megatron-LM "
        "(scan -> plan -> encode -> merge). Run `mmtok COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"mmtok {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"mmtok.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away is seen here, not in the interpreter's final flush
        return code
    except MmtokError as err:
        print(f"mmtok {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, read-only output, unreadable input: one line, not a traceback
        if isinstance(err, BrokenPipeError) and _stdout_reader_gone():
            # `mmtok status OUT --json | head`: the reader has what it wanted; say nothing more. stdout goes
            # to devnull so the interpreter's final flush of what is still buffered cannot fail again. 141
            # is 128 + SIGPIPE, what a shell reports for a writer the signal stopped (`yes | head`): the
            # pipeline still ends with the reader's status, and `set -o pipefail` still sees the cut output.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        print(f"mmtok {args.command}: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mmtok {args.command}: interrupted", file=sys.stderr)
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone; False for a broken pipe of the
    command's own, which is an error like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except (OSError, ValueError):  # no descriptor of its own (stdout captured in-process)
        return False


# What to do about the OS errors a long run meets; every stage is restartable, so the advice ends in a rerun.
OS_ERROR_FIXES = {
    errno.ENOSPC: "free space on that file system (or use another --out), then rerun the same command (scan, "
                  "encode and audio convert resume where they stopped)",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota, then rerun the same command",
    errno.EROFS: "the file system is read-only: use a writable --out (or remount it read-write), then rerun",
    errno.EACCES: "no permission: fix the permissions or use another location, then rerun",
    errno.EPERM: "not permitted: fix the permissions or use another location, then rerun",
    errno.EIO: "an I/O error: the disk or the file is damaged; check it (dmesg), restore the file, then rerun",
    errno.ENOENT: "check the path (a file or directory that the command needs is missing)",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n), then rerun",
}


def os_error_line(err: OSError) -> str:
    """'<path>: <what the OS said> [ERRNO] -- <what to do>' for an OSError."""
    where = " -> ".join(str(name) for name in (err.filename, err.filename2) if name is not None)
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    what = f"{err.strerror or err} [{code}]" if code else str(err.strerror or err)
    fix = OS_ERROR_FIXES.get(err.errno, "fix the cause, then rerun the same command")
    return f"{where + ': ' if where else ''}{what} -- {fix}"


if __name__ == "__main__":
    sys.exit(main())
