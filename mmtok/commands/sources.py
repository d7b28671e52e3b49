"""Source declarations (`manifests/*.yaml`): a corpus' inputs and options, kept next to the code.

    name: demo
    modality: image                 # image (for `mmtok scan`) or audio (for `mmtok audio convert`)
    inputs: [shards/demo-*.tar]     # paths or globs; relative ones are relative to --root
    options: {text_column: caption} # the command's options, by flag name (dashes or underscores)

`mmtok scan --source FILE` and `mmtok audio convert --source FILE` read it: its inputs come after any
given on the command line, and an option given on the command line wins over the declaration's.
`--root` defaults to the declaration's own directory.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from mmtok.errors import MmtokError

PATH_OPTIONS = ("transcripts", "shard_list", "media_root")  # option values that are paths (or lists of them),
# resolved against the root


@dataclass(frozen=True)
class SourceDeclaration:
    name: str
    modality: str
    inputs: list[str]
    options: dict


def load_source(path: str | Path, root: str | Path | None = None) -> SourceDeclaration:
    """Read a declaration, resolving relative inputs and path options against `root` (default: its folder)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise MmtokError(f"cannot read source declaration {path}: {err}") from None
    unknown = set(data) - {"name", "description", "modality", "inputs", "options", "notes"}
    if unknown:
        raise MmtokError(f"{path}: unknown keys {sorted(unknown)} (allowed: name, description, modality, inputs, "
                         "options, notes)")
    base = Path(root) if root is not None else path.parent
    inputs = data.get("inputs") or []
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise MmtokError(f"{path}: `inputs` must be a list of paths or globs")
    options = {str(k).replace("-", "_"): v for k, v in (data.get("options") or {}).items()}
    for key in PATH_OPTIONS:
        if isinstance(options.get(key), str):
            options[key] = str(base / options[key])
        elif isinstance(options.get(key), list):
            options[key] = [str(base / value) for value in options[key]]
    return SourceDeclaration(name=str(data.get("name", path.stem)), modality=str(data.get("modality", "image")),
                             inputs=[str(base / i) for i in inputs], options=options)


def apply_source(args: argparse.Namespace, parser: argparse.ArgumentParser, source: SourceDeclaration,
                 modality: str) -> list[str]:
    """Fill options the user left at their defaults from the declaration; return its inputs."""
    if source.modality != modality:
        raise MmtokError(f"source {source.name!r} declares modality {source.modality!r}; this command takes "
                         f"{modality!r} sources")
    actions = {action.dest: action for action in parser._actions}
    for key, value in source.options.items():
        if key not in actions:
            raise MmtokError(f"source {source.name!r}: {key!r} is not an option of this command")
        action = actions[key]
        if getattr(args, key) == action.default:  # not given on the command line
            setattr(args, key, action.type(value) if action.type and isinstance(value, str) else value)
    return source.inputs


def add_media_root(parser: argparse.ArgumentParser) -> None:
    """`--media-root DIR` (repeatable), the one declaration of the flag for every command that reads
    conversations' media files (pack, sft, audio convert): the roots a file reference may resolve into."""
    parser.add_argument("--media-root", type=Path, action="append", default=[], metavar="DIR",
                        help="a directory that conversations' media file paths may resolve into, besides each "
                        "input's own directory (repeatable; a relative path is looked for there after the input's "
                        "directory). A path elsewhere -- absolute, escaping with `..`, or a symlink whose target "
                        "leaves every root -- is skipped as outside_root; FIFOs, devices and directories are never "
                        "opened (not_a_file)")
