"""`mmtok ... | head`: a reader that goes away early ends the command quietly."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

from mmtok.cli import main


def test_a_closed_stdout_pipe_is_a_quiet_exit_141(tmp_path):
    (tmp_path / "parts").mkdir()  # an encode output with no part yet: `status --json` still prints a report
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte, as after `head` exits
    try:
        done = subprocess.run([sys.executable, "-m", "mmtok.cli", "status", str(tmp_path), "--json"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_a_broken_pipe_of_the_command_itself_is_still_an_error(monkeypatch, capsys):
    def run(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # e.g. a pipe to a helper process, stdout still read

    monkeypatch.setattr("mmtok.commands.status.run", run)
    assert main(["status", "OUT"]) == 2
    assert "mmtok status: error: Broken pipe [EPIPE]" in capsys.readouterr().err
