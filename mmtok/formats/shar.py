"""mmtok's conventions around Lhotse Shar: the one module that knows them (writer and reader side by side).

`mmtok audio convert` writes, `mmtok encode --modality audio` reads:

  OUT/shar/cuts.NNNNNN.jsonl.gz    the cuts of shard NNNNNN (indices 0..n-1), written by lhotse's SharWriter
                                   (its gzip header time set to 0: equal clips give equal bytes)
  OUT/shar/recording.NNNNNN.tar    their audio: one member `<cut id>.flac` per cut (the `recording` field)
  OUT/conversion.json              the conversion report (REPORT_FORMAT, `ConversionReport`): `shards`
                                   (index, cuts, duration, cuts_sha256, recording_sha256), `complete`,
                                   counts and the resume cursor; rewritten atomically after every shard,
                                   its shape checked when it is read back
  OUT/dropped/dropped.{inputs,NNNNNN,tail}.jsonl
                                   the skip records (`mmtok.formats.skips`) of what the inputs, shard
                                   NNNNNN's units and the run's tail dropped
  OUT/.work/shard-NNNNNN/          a shard being written; moved into OUT/shar only when complete

Nothing else lives in OUT/shar, because lhotse treats every file there as a Shar field. lhotse writes
and reads the files themselves (`SharWriter`, `CutSet.from_shar`, `CutSet.from_file`); this module
knows the names, the member naming, the report and what identifies a shard. A bare Lhotse Shar
directory (no report) is read too: durations then come from its cuts manifests.

Checked bytes: lhotse's Shar reader verifies nothing (a tar header checksum at most), so the report
records each shard's sha256 (of the recording tar, and of the decompressed cuts manifest: gzip headers
carry a time) and `verify_shard` compares them before encode trusts a shard. Each cut records in
`custom[SOURCE_DIGEST]` the sha256 of the bytes its clip was converted from (`source_digest`), which the
audio token cache keeps, so `mmtok sft` can tell a medium changed since its conversion (`stale_media`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmtok.errors import DamagedFile, MmtokError, brief
from mmtok.formats.tar import Damage, read_members
from mmtok.fsutil import (
    atomic_write_json,
    fsync_dir,
    publish_file,
    read_json_object,
    required,
    required_count,
    required_counts,
    required_number,
    sha256_file,
    within,
)

SHAR_DIR = "shar"
WORK_DIR = ".work"
SKIPPED_DIR = "dropped"  # the skip lists (the name predates `skipped:` counters: kept for existing outputs)
REPORT = "conversion.json"
REPORT_FORMAT = "mmtok-audio-convert/2"  # /2: shards' recording_sha256, cuts' source_sha256
SOURCE_DIGEST = "source_sha256"  # cut.custom key: sha256 of the bytes the clip was converted from
FIELDS = {"recording": "flac"}  # SharWriter fields: each cut's audio is the tar member `<cut id>.flac`
AUDIO_EXTENSIONS = ("flac", "wav", "mp3", "opus", "ogg")  # recording members a (foreign) Shar may hold
CUTS_GLOB = "cuts.*.jsonl.gz"


# --- names ------------------------------------------------------------------------------------------

def shard_files(index: int) -> tuple[str, str]:
    """(cuts manifest, recording tar) file names of shard `index`."""
    return f"cuts.{index:06d}.jsonl.gz", f"recording.{index:06d}.tar"


def skip_list(out: Path, name: str) -> Path:
    """OUT's skip list `name` ("inputs", a shard's "NNNNNN", "tail")."""
    return out / SKIPPED_DIR / f"dropped.{name}.jsonl"


def skip_lists(out: Path) -> list[Path]:
    """Every skip list of a conversion output, by name; MmtokError when OUT is not one."""
    if not (out / SKIPPED_DIR).is_dir():
        raise MmtokError(f"{out}: not an `mmtok audio convert` output (no {SKIPPED_DIR}/ folder)")
    return sorted((out / SKIPPED_DIR).glob("dropped.*.jsonl"))


def shard_work_dir(out: Path, index: int) -> Path:
    """Where shard `index` of OUT is written before `publish_shard` moves it into OUT/shar."""
    return out / WORK_DIR / f"shard-{index:06d}"


# --- writer side ------------------------------------------------------------------------------------

def clear_gzip_mtime(path: Path) -> None:
    """Set the modification time in the gzip header of `path` (lhotse's writer puts the clock there) to 0,
    "no time stamp" in RFC 1952: the same clips give the same bytes. A header with its own CRC (FHCRC) is
    left alone (Python's gzip never writes one)."""
    with open(path, "r+b") as handle:
        header = handle.read(4)
        if len(header) == 4 and header[:3] == b"\x1f\x8b\x08" and not header[3] & 0x02:
            handle.write(b"\0\0\0\0")  # MTIME: bytes 4..7


def publish_shard(out: Path, index: int) -> Path:
    """Move the complete shard `index` from its work directory into OUT/shar (each file fsynced, then
    renamed; the directory fsynced); returns its cuts manifest's path."""
    work, shar = shard_work_dir(out, index), out / SHAR_DIR
    clear_gzip_mtime(work / shard_files(index)[0])
    for name in shard_files(index):
        publish_file(work / name, shar / name)
    fsync_dir(shar)
    shutil.rmtree(work)
    return shar / shard_files(index)[0]


def shard_record(cuts_path: Path, cuts: int, duration: float) -> ShardRecord:
    """The report's record of the shard of `cuts_path` (just published): its digests, to verify it (and its
    recording tar) by."""
    index = int(cuts_path.name.split(".")[1])
    recording = cuts_path.with_name(shard_files(index)[1])
    return ShardRecord(index=index, cuts=cuts, duration=duration, cuts_sha256=manifest_sha256(cuts_path),
                       recording_sha256=sha256_file(recording))


def source_digest(data: bytes) -> str:
    """The digest a clip records of the bytes it was converted from (SOURCE_DIGEST)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard as the report records it: what encode verifies it by (`verify_shard`)."""

    index: int
    cuts: int
    duration: float  # seconds of audio
    cuts_sha256: str  # of the decompressed cuts manifest
    recording_sha256: str  # of the recording tar

    @classmethod
    def from_json(cls, value, path: Path) -> ShardRecord:
        return cls(index=required_count(value, "index", path), cuts=required_count(value, "cuts", path),
                   duration=required_number(value, "duration", path, minimum=0),
                   cuts_sha256=required(value, "cuts_sha256", str, path),
                   recording_sha256=required(value, "recording_sha256", str, path))





@dataclass(frozen=True)
class Cursor:
    """Where a conversion resumes: unit `unit` of the inputs, after its first `skip` results (in shards)."""

    unit: int = 0
    skip: int = 0


@dataclass(frozen=True)
class ConversionReport:
    """OUT/conversion.json: the run's identity (checked on resume), whether it is complete, the resume cursor,
    the shards written, the counts by reason. `to_json()` is the file: `format` first, then the fields in order."""

    identity: dict  # what the conversion depends on (inputs, options, tokenizer...): resume compares it
    complete: bool = False
    cursor: Cursor = Cursor()
    shards: tuple[ShardRecord, ...] = ()
    counts: dict[str, int] = field(default_factory=dict)  # "in", "written", skip and "ignored:EXT" counters
    duration_written: float = 0.0  # seconds, the shards' sum

    def to_json(self) -> dict:
        return {"format": REPORT_FORMAT, **asdict(self)}  # shards: a tuple of objects, a JSON list

    @classmethod
    def from_json(cls, document: dict, path: Path) -> ConversionReport:
        """The report of `document` (a parsed conversion.json), its shape checked: DamagedFile naming the key."""
        cursor = required(document, "cursor", dict, path)
        counts = required_counts(document, "counts", path)
        shards = tuple(ShardRecord.from_json(value, within(path, f"shards[{i}]"))
                       for i, value in enumerate(required(document, "shards", list, path)))
        if [s.index for s in shards] != list(range(len(shards))):  # written in order, one record per shard
            raise DamagedFile(f"{path}: key 'shards' must record shards 0..{len(shards) - 1} in order, not "
                              f"{brief([s.index for s in shards], 60)}; re-run `mmtok audio convert` into a new --out")
        identity = required(document, "identity", dict, path)
        for key in ("text_tokenizer", "options", "storage"):  # what encode reads of the conversion
            required(identity, key, dict, within(path, "identity"))
        return cls(identity=identity, complete=required(document, "complete", bool, path),
                   cursor=Cursor(unit=required_count(cursor, "unit", within(path, "cursor")),
                                 skip=required_count(cursor, "skip", within(path, "cursor"))),
                   shards=shards, counts=counts,
                   duration_written=required_number(document, "duration_written", path,
                                                    sum(s.duration for s in shards), minimum=0))


def write_conversion_report(out: Path, report: ConversionReport) -> None:
    """Atomically (re)write OUT/conversion.json."""
    atomic_write_json(out / REPORT, report.to_json())


# --- reader side ------------------------------------------------------------------------------------

def read_report(out: Path) -> ConversionReport | None:
    """OUT/conversion.json, or None when OUT has none; refuses a report of another format or shape."""
    report = read_json_object(out / REPORT)
    if report is None:
        return None
    if report.get("format") != REPORT_FORMAT:
        raise MmtokError(f"{out / REPORT}: a conversion of format {report.get('format')!r} (before shard checksums); "
                         f"this mmtok reads {REPORT_FORMAT}: re-run `mmtok audio convert` into a new --out")
    return ConversionReport.from_json(report, out / REPORT)


def _manifest_bytes(path: Path) -> bytes:
    """A cuts manifest's decompressed bytes; MmtokError naming the file when it does not decompress."""
    try:
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise MmtokError(f"{path}: the cuts manifest does not decompress ({err}): bit rot or a damaged copy; "
                         "re-run `mmtok audio convert` into a new --out") from None


def manifest_sha256(path: Path) -> str:
    """sha256 of a decompressed cuts manifest (gzip headers carry a timestamp, the content does not)."""
    return hashlib.sha256(_manifest_bytes(path)).hexdigest()


def read_cut_dicts(path: Path) -> list[dict]:
    """The cuts of one cuts manifest as JSON dicts, in order; MmtokError naming the file when it is damaged."""
    try:
        return [json.loads(line) for line in _manifest_bytes(path).decode("utf-8").split("\n") if line.strip()]
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError
        raise MmtokError(f"{path}: not a cuts manifest ({err}); re-run `mmtok audio convert` into a new "
                         "--out") from None


@dataclass(frozen=True)
class SharShard:
    index: int
    cuts_path: Path
    recording_path: Path
    duration: float
    num_cuts: int
    recorded: ShardRecord | None = None  # the report's record of the shard (None: a bare Shar, nothing to verify)


def shar_location(path: Path) -> tuple[Path, ConversionReport | None]:
    """(Shar directory, conversion report or None) for a `mmtok audio convert` output or a bare Shar dir."""
    report = read_report(path) if (path / SHAR_DIR).is_dir() else None
    if report is not None:
        if not report.complete:
            raise MmtokError(f"{path / REPORT}: the conversion is not complete; rerun `mmtok audio convert` with the "
                             "same arguments to finish it before encoding")
        return path / SHAR_DIR, report
    if not any(path.glob(CUTS_GLOB)):
        raise MmtokError(f"{path}: no Shar shards (cuts.NNNNNN.jsonl.gz); pass the --out of `mmtok audio convert` "
                         "or a Lhotse Shar directory")
    return path, None


def discover_shards(path: Path) -> tuple[list[SharShard], ConversionReport | None]:
    """Every shard 0..n-1 of a Shar directory with its total duration (from the conversion report when
    there is one, else summed from the cuts manifests)."""
    shar, report = shar_location(path)
    indices = sorted(int(p.name.split(".")[1]) for p in shar.glob(CUTS_GLOB))
    if indices != list(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - set(indices))
        raise MmtokError(f"{shar}: shard indices must be 0..n-1; missing {missing[:10]}")
    recorded = {s.index: s for s in report.shards} if report else {}
    if report is not None and indices != sorted(recorded):  # a shard no record verifies, or a record without files
        raise MmtokError(f"{shar}: holds shards {_listed(indices)} but {REPORT} records {_listed(sorted(recorded))}; "
                         "re-run `mmtok audio convert` into a new --out")
    shards = []
    for index in indices:
        cuts_name, recording_name = shard_files(index)
        if not (shar / recording_name).is_file():
            raise MmtokError(f"{shar / recording_name}: missing (every Shar shard needs its recording tar)")
        if index in recorded:
            duration, count = recorded[index].duration, recorded[index].cuts
        else:
            durations = [c["duration"] for c in read_cut_dicts(shar / cuts_name)]
            duration, count = sum(durations), len(durations)
        shards.append(SharShard(index, shar / cuts_name, shar / recording_name, float(duration), int(count),
                                recorded.get(index)))
    return shards, report


def _listed(indices: list[int]) -> str:
    """Shard indices for a message: the range when they are 0..n-1, else the first few."""
    if indices == list(range(len(indices))):
        return f"0..{len(indices) - 1}" if indices else "none"
    return ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")


def shard_fingerprint(shard: SharShard) -> dict:
    """What identifies a shard's content for resume checks: the decompressed cuts manifest's sha256
    (gzip headers carry a timestamp) and the recording tar's size."""
    return {"index": shard.index, "cuts_sha256": manifest_sha256(shard.cuts_path),
            "recording_bytes": shard.recording_path.stat().st_size, "cuts": shard.num_cuts}


def verify_shard(shard: SharShard) -> None:
    """Refuse (MmtokError naming the file) a shard whose recording tar or cuts manifest differs from what
    its conversion recorded; a bare Shar's shards have no record and pass."""
    if shard.recorded is None:
        return
    found = ((shard.cuts_path, manifest_sha256(shard.cuts_path), shard.recorded.cuts_sha256),
             (shard.recording_path, sha256_file(shard.recording_path), shard.recorded.recording_sha256))
    for path, digest, recorded in found:
        if digest != recorded:
            raise MmtokError(f"{path}: does not match the sha256 that {REPORT} recorded (bit rot, a damaged copy or "
                             "a changed file); re-run `mmtok audio convert` into a new --out")


def index_members(recording_path: Path) -> tuple[dict[str, tuple[int, int] | str], str | None]:
    """cut id -> (data offset, size) of its audio member in a Shar recording tar (headers only), or the
    "reason: detail" the member is refused for (`mmtok.formats.tar.Member`); and the tar's first damage
    as "reason: detail" (None for a sound tar): the reason of a cut whose member is not found."""
    members: dict[str, tuple[int, int] | str] = {}
    damage = None
    for entry in read_members(recording_path):
        if isinstance(entry, Damage):
            damage = damage or f"{entry.reason}: {recording_path} {entry.describe()}"
            continue
        name, _, ext = entry.name.rpartition(".")
        if ext in AUDIO_EXTENSIONS:
            members[name] = (f"{entry.reason}: member {entry.name} of {recording_path}" if entry.reason
                             else (entry.offset, entry.size))
    return members, damage
