"""The one place codec names are mapped to code: the Python entry-point group `mmtok.codecs`.

Every codec, the built-in ones included, is a module (or any object with the same attributes) registered in
that group by its distribution's metadata (`[project.entry-points."mmtok.codecs"]` in pyproject.toml):

    [project.entry-points."mmtok.codecs"]
    emu3.5 = "mmtok.codecs.emu35"

so a third-party package adds a codec by installing itself, with no edit to mmtok (docs/write-a-codec.md). What
such a module must provide is `CodecPlugin` (mmtok/codecs/base.py); what its `load` returns, `Codec`. Both are
checked when a codec is first used, and a plugin that fails to import or breaks the contract is one MmtokError
naming the plugin and its distribution -- only when that codec is asked for: a broken plugin never hides the
others. Plugins are imported lazily, by name: listing names reads only the metadata.

The built-in codecs are also known by module path (`BUILT_IN`), for a checkout run without being installed
(`PYTHONPATH=.`), where no metadata registers them; where the metadata does, they must name the same modules.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mmtok.codecs.base import Codec, CodecPlugin, check_codec, check_plugin
from mmtok.errors import MmtokError

GROUP = "mmtok.codecs"
# The built-in codecs as pyproject.toml registers them (the same module paths; see the module docstring).
BUILT_IN = {"emu3.5": "mmtok.codecs.emu35", "emu3": "mmtok.codecs.emu3", "wavtokenizer": "mmtok.codecs.wavtokenizer"}
DEFAULTS = {"image": "emu3.5", "audio": "wavtokenizer"}  # the codec a stage uses when none is named


@dataclass(frozen=True)
class Entry:
    """One registered codec: its name, what the registration points at, and who registered it."""

    name: str
    value: str  # "module" or "module:attribute"
    distribution: str  # the registering distribution's name ("mmtok" for the built-in codecs)


@functools.cache
def entries() -> dict[str, tuple[Entry, ...]]:
    """Every registration by codec name, in the order found (more than one: the name is refused when used)."""
    found: dict[str, list[Entry]] = {}
    for point in metadata.entry_points(group=GROUP):
        distribution = point.dist.name if point.dist is not None else "?"
        entry = Entry(point.name, point.value, distribution)
        if entry not in found.setdefault(point.name, []):  # a distribution seen twice on sys.path is one
            found[point.name].append(entry)
    for name, module in BUILT_IN.items():
        registered = found.setdefault(name, [])
        if not any(entry.value == module for entry in registered):
            registered.insert(0, Entry(name, module, "mmtok"))
    return {name: tuple(registered) for name, registered in found.items()}


def names(modality: str | None = None) -> list[str]:
    """The registered codec names, sorted; with `modality`, only the codecs of that modality (this imports
    each plugin, to read its MODALITY; a plugin that fails is left out here and named when it is used)."""
    if modality is None:
        return sorted(entries())
    kept = []
    for name in sorted(entries()):
        try:
            if plugin(name).MODALITY == modality:
                kept.append(name)
        except MmtokError:
            continue
    return kept


@functools.cache
def plugin(name: str) -> CodecPlugin:
    """The plugin registered as codec `name`, imported and checked against `CodecPlugin`; MmtokError naming the
    plugin when there is none, more than one, or it cannot be imported or breaks the contract."""
    registered = entries().get(name)
    if not registered:
        raise MmtokError(f"unknown codec {name!r}; registered codecs: {', '.join(names())} (a codec is added by "
                         f"installing a package that registers it in the {GROUP!r} entry-point group)")
    if len(registered) > 1:
        listed = "; ".join(f"{entry.value} (from {entry.distribution})" for entry in registered)
        raise MmtokError(f"codec {name!r} is registered more than once: {listed}; uninstall one of them")
    entry = registered[0]
    where = _where(entry)
    module, _, attribute = entry.value.partition(":")
    found = _calling(where, "import", lambda: _resolve(module.strip(), attribute.strip()))
    check_plugin(found, where)
    return found


def _resolve(module: str, attribute: str):
    found = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        found = getattr(found, part)
    return found


def _calling(where: str, what: str, call):
    """`call()`, where it runs a stranger's code: anything it raises but an MmtokError or an OSError (already
    one line each) becomes one MmtokError naming the plugin -- SystemExit included, so a plugin cannot end the
    process; only Ctrl-C passes."""
    try:
        return call()
    except (MmtokError, OSError, KeyboardInterrupt):
        raise
    except BaseException as err:
        message = str(err).splitlines()[0] if str(err) else ""
        raise MmtokError(f"{where}: {what} failed: {type(err).__name__}: {message}") from None


def _where(entry: Entry) -> str:
    """How errors name a plugin: its codec name, what it registered and the distribution that did."""
    return f"codec plugin {entry.name!r} ({entry.value}, from {entry.distribution})"


def of_modality(name: str, modality: str, flag: str = "--codec") -> CodecPlugin:
    """The plugin of codec `name`, refused in one line unless it is a `modality` codec."""
    found = plugin(name)
    if found.MODALITY != modality:  # the names from the metadata alone: listing them imports no other plugin
        raise MmtokError(f"{flag} {name} is an {found.MODALITY} codec; this needs an {modality} codec "
                         f"(registered codecs: {', '.join(names())})")
    return found


def load_codec(name: str, checkpoint: str | os.PathLike, device="cpu", modality: str | None = None) -> Codec:
    """Codec `name` loaded from its checkpoint directory onto `device`, in eval mode, checked against `Codec`;
    with `modality`, refused first unless it is a codec of that modality."""
    import torch

    found = plugin(name) if modality is None else of_modality(name, modality)
    path = Path(checkpoint)
    if not path.exists():
        raise MmtokError(f"{name}: checkpoint not found: {path}")
    where = _where(entries()[name][0])
    codec = _calling(where, "load()", lambda: found.load(path, torch.device(device)))
    check_codec(codec, found, name, where)
    return codec.eval()


def checkpoint_sha256(name: str, checkpoint: str | os.PathLike) -> str | None:
    """The `checkpoint_sha256` codec `name` will record for `checkpoint` once loaded, computed without loading
    it (so a run can be compared with an earlier one first); None when a file is missing (the load says so)."""
    from mmtok.codecs.base import checkpoint_fingerprint

    found = plugin(name)
    paths = _calling(_where(entries()[name][0]), "checkpoint_paths()",
                     lambda: [Path(path) for path in found.checkpoint_paths(Path(checkpoint))])
    return checkpoint_fingerprint(paths) if all(path.is_file() for path in paths) else None
