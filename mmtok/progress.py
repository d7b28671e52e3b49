"""Progress for long commands: a live tqdm bar on a terminal, plain timestamped lines in a log.

Under srun/sbatch stderr is a file: a tqdm bar there becomes one endless line of carriage returns.
`progress(...)` gives the same tqdm object either way; off a terminal it prints a full line (count,
percent, rate, elapsed, ETA, postfix) at most every `MMTOK_LOG_INTERVAL` seconds (default 60) and
once at the end, so a log reads
`2026-12-01 09:41:34 encode rank 3: 4100/10000 img (41%), 41.0img/s, elapsed 01:40, ETA 02:24, busy 99%`.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


class LogLines(tqdm):
    """tqdm that writes whole lines (with a timestamp) instead of redrawing one line in place."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        line = msg if msg is not None else self.format_meter(**self.format_dict)
        self.fp.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line.strip()}\n")
        self.fp.flush()
        return True

    def close(self) -> None:
        if not self.disable and self.last_print_n != self.n:
            self.display()  # the final count, unless the last line already showed it
        self.disable = True  # tqdm's own close would redraw; our last line is written
        super().close()


def log_interval() -> float:
    try:
        return max(float(os.environ.get("MMTOK_LOG_INTERVAL", "60")), 0.0)
    except ValueError:
        return 60.0


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
             initial: int = 0, **options) -> tqdm:
    """A progress bar on stderr: live on a terminal, periodic plain lines in a log, nothing when disabled."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr, **options)
    options.pop("mininterval", None)  # a log gets a line per interval, however often a terminal redraws
    options.pop("unit_scale", None)  # whole counts in a log ("13/13 row", not "13.0/13.0")
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    line = (f"{{desc}}: {{n_fmt}}/{{total_fmt}} {unit} ({{percentage:.0f}}%), {{rate_fmt}}, elapsed {{elapsed}}, "
            "ETA {remaining}{postfix}" if total
            else "{desc}: {n_fmt} " + unit + ", {rate_fmt}, elapsed {elapsed}{postfix}")
    return LogLines(iterable, total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr,
                    mininterval=log_interval(), maxinterval=float("inf"), miniters=1, bar_format=line, **options)
