"""WebDataset samples: a tar's members grouped by sample key, the one grouping every stage that reads a
tar's samples uses (`mmtok sft`/`mmtok pack` for conversations, `mmtok audio convert` for clips).

A member's *sample key* is its name up to the first dot of the base name, directories included
(`sample_key`): `a/b.0.jpg` is sample `a/b`, extension `0.jpg`. A sample is a run of consecutive members
sharing a key (`read_samples`). What a member holds is told by its extension (`AUDIO_SUFFIXES`,
`IMAGE_SUFFIXES`), never by sniffing bytes here.

A key that names more than one sample of a tar, or a sample holding one member name twice, is *repeated*:
which media belong to which record is then unknowable (the scan files a key's images together), so every
sample of such a key is `duplicate_key` in every stage, never another sample's media.

The scan splits keys inline in its hot loop (`mmtok.scan.scanner`); tests/test_formats_tar.py checks it
splits them as `sample_key` does.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from mmtok.formats.containers import FROM_FIRST, Record, Start
from mmtok.formats.tar import KIND_REASONS, NON_UTF8_NAME, TRUNCATED, Damage, Member, read_members

# Media by extension, the one list each: audio without a probe (tars: the only audio), images the scan reads.
AUDIO_SUFFIXES = ("wav", "flac", "ogg", "oga", "opus", "mp3")
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
KIND_SUFFIXES = {"audio": AUDIO_SUFFIXES, "image": IMAGE_SUFFIXES}

TRUNCATED_MEMBER = KIND_REASONS[TRUNCATED]
NO_SAMPLES = "no_samples"  # a tar without one member named KEY.EXT
DUPLICATE_KEY = "duplicate_key"  # a key that names more than one sample of a tar


def sample_key(member: str) -> tuple[str, str] | None:
    """(WebDataset sample key, extension) of a tar member name: the key is everything before the first dot
    of the base name, directories included; None for a name without a dot (no sample's member)."""
    directory, _, base = member.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot:
        return None
    return (f"{directory}/{stem}" if directory else stem), ext


@dataclass(frozen=True)
class Sample:
    """One sample of a tar, in tar order: its members, and the damage that ended it when one did.

    `key` is None for damage met where no sample was open (what it cut belongs to no sample read).
    `repeated` says how the key names more than one sample ("" when it names this one only); `occurrence`
    is which of the key's samples this is (1 for the first).
    """

    key: str | None
    members: list[Member] = field(default_factory=list)
    damage: Damage | None = None
    repeated: str = ""
    occurrence: int = 1


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """Every sample of the tar at `path` in tar order (headers only: no member's data is read), each marked
    when its key is repeated. OSError when the file cannot be read."""
    samples = _grouped(path)
    repeated = _repeated_keys(samples)
    seen: Counter = Counter()
    for at, sample in enumerate(samples):
        if sample.key in repeated:
            seen[sample.key] += 1
            samples[at] = replace(sample, repeated=repeated[sample.key], occurrence=seen[sample.key])
    return samples


class TarSamples:
    """The `mmtok.formats.containers.Container` of tar files: a record per sample (`read_samples`), its value the
    `Sample`, `where` its key (or where damage met outside any sample was). The whole
    header list is read first (which keys repeat is known before any sample is used); records before
    `start.record` are not made. OSError when the file cannot be read."""


    def records(self, path: Path, start: Start = FROM_FIRST) -> Iterator[Record]:
        samples = read_samples(path)
        for number in range(start.record, len(samples)):
            sample = samples[number]
            where = sample.key if sample.key is not None else f"(damaged tar at byte {sample.damage.offset})"
            yield Record(number, where, sample)


def _grouped(path: str | os.PathLike) -> list[Sample]:
    """The samples of the tar: consecutive members sharing a key, the damage that ended a sample when one
    did; Sample(None, [], damage) for damage where no sample is open.

    After damage, the members of the same key that follow the resync are the damaged sample's: they join it
    (what the damage cut is lost; what follows it is not another sample). A member whose name is not UTF-8
    cannot be trusted to name its sample: it joins the open sample, refused, unless the member after it shares
    its (escaped) key -- a sample named so throughout.
    """
    samples: list[Sample] = []
    key, members, held, absorbed = None, [], [], None
    for entry in read_members(path):
        if isinstance(entry, Damage):
            samples.append(Sample(key, members + held, entry))
            key, members, held, absorbed = None, [], [], key
            continue
        named = sample_key(entry.name)
        if named is None:
            continue
        if named[0] == absorbed:
            samples[-1].members.append(entry)
            continue
        name, absorbed = named[0], None
        if held:
            if name == sample_key(held[0].name)[0]:  # a sample whose key is not UTF-8: its own
                if key is not None:
                    samples.append(Sample(key, members))
                key, members = name, []
            members, held = members + held, []
        if name != key and key is not None and entry.reason == NON_UTF8_NAME:
            held.append(entry)
            continue
        if name != key:
            if key is not None:
                samples.append(Sample(key, members))
            key, members = name, []
        members.append(entry)
    if key is not None:
        samples.append(Sample(key, members + held))
    return samples


def _repeated_keys(samples: list[Sample]) -> dict[str, str]:
    """The keys that name more than one sample (or one sample that holds a member name twice), with how."""
    counts = Counter(sample.key for sample in samples if sample.key is not None)
    repeated = {key: f"{count} samples of this tar are named {key!r}" for key, count in counts.items() if count > 1}
    for sample in samples:
        names = Counter(member.name for member in sample.members)
        twice = sorted(name for name, count in names.items() if count > 1)
        if sample.key is not None and twice and sample.key not in repeated:
            repeated[sample.key] = f"sample {sample.key!r} holds member {twice[0]} {names[twice[0]]} times"
    return repeated


def duplicate_key_detail(sample: Sample) -> str:
    """The detail of a repeated sample's `duplicate_key` skip, in every stage's words."""
    return f"{sample.repeated}: a WebDataset key names one sample; rename or drop the repeats"
