"""Optional parts of mmtok (pyproject.toml's extras) and the one message a missing one gives.

`pip install mmtok` brings what scan, plan, encode, merge, inspect, audio and demo need. The extras:

- `bench`: matplotlib, scikit-image, pesq, pystoi -- `mmtok bench reconstruct` (its report and metrics).
- `megatron`: megatron-core -- `mmtok merge` reads its output back with megatron-core's IndexedDataset;
  without it, merge verifies with mmtok's own reader (and says so), so nothing else needs it.

Code that needs an extra's module imports it through `require`, so a missing one is one line and exit
status 2 (`MmtokError`), never an ImportError traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mmtok.errors import MmtokError

EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("matplotlib", "skimage.metrics", "pesq", "pystoi"),
    "megatron": ("megatron.core",),
}


def missing_message(extra: str, command: str, err: ImportError) -> str:
    return f"{command} needs the {extra} extra: pip install 'mmtok[{extra}]' ({err})"


def require(module: str, extra: str, command: str) -> ModuleType:
    """`module`, imported; if it cannot be, MmtokError naming `command`, the extra and the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MmtokError(missing_message(extra, command, err)) from None


def require_extra(extra: str, command: str) -> None:
    """Check every module of `extra` before a long run starts (not after hours, at the report)."""
    for module in EXTRAS[extra]:
        require(module, extra, command)

