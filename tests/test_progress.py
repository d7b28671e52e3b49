"""Progress in a log file (as under srun): whole timestamped lines, never carriage-return redraws."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from encodekit import caption_corpus

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d scan: (\d+)/3 shard \((\d+)%\), .*elapsed \d\d:\d\d, ETA ")


def test_progress_in_a_log_is_plain_lines_with_count_rate_and_eta(tmp_path):
    caption_corpus(tmp_path / "data")
    log = tmp_path / "scan.log"
    with open(log, "wb") as handle:  # stderr is a file, not a terminal
        subprocess.run([sys.executable, "-m", "mmtok", "scan", str(tmp_path / "data" / "*.tar"), "--out",
                        str(tmp_path / "manifest"), "--workers", "1"], stderr=handle, stdout=handle, check=True,
                       env={**os.environ, "MMTOK_LOG_INTERVAL": "0"})
    text = log.read_text()
    assert "\r" not in text and "\x1b" not in text
    counts = [int(m.group(1)) for m in map(LINE.match, text.splitlines()) if m]
    assert counts[0] == 0 and counts[-1] == 3 and counts == sorted(counts), text
    assert text.splitlines()[-1].startswith("mmtok scan: 3 shards"), text  # the summary comes last


def test_a_log_gets_a_line_per_interval_not_per_update(tmp_path, monkeypatch, capsys):
    from mmtok.progress import progress

    monkeypatch.setenv("MMTOK_LOG_INTERVAL", "3600")
    with progress(total=1000, desc="work", unit="item") as bar:
        for _ in range(1000):
            bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "0/1000 item (0%)" in lines[0] and "1000/1000 item (100%)" in lines[1], lines
