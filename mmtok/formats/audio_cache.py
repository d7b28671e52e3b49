"""The audio token cache: written by `mmtok encode --modality audio`, read by `mmtok audio interleave`.

One Parquet file per part (= input Shar shard): `OUT/audio-cache/part-00003.parquet`, one row per
encoded clip in the shard's cut order. Columns:

  cut_id          string   the Lhotse cut id
  source_id       string   recording the clip was cut from (runs for interleaving are per source)
  clip            int64    clip number inside that recording (a gap breaks a run)
  part            int32    Shar shard index
  position        int32    index of the cut in its shard's cuts manifest
  duration        float64  seconds at 24 kHz
  language        string   (null when unknown)
  target_language string   (null unless the text is a translation)
  audio_ids       list<int32>  vocabulary ids of the kept codes (ceil(n/600) - 5 of them)
  text_ids        list<int32>  text token ids without BOS/EOS (null when the clip has no text)
  source_sha256   string   sha256 of the bytes the clip was converted from (`cut.custom["source_sha256"]`;
                           null for a foreign Shar): what binds the tokens to their medium

The file's key-value metadata `mmtok` holds JSON: format (CACHE_FORMAT), part, num_parts, vocabulary
layout, text tokenizer, codec description and the trim rule, so a reader can check that all parts agree.

Checked bytes: next to each part, `part-00003.parquet.sha256` holds the sha256 of the whole file
(`sha256sum -c` reads it). `find_cache_parts` -- the one way readers reach the parts -- verifies every part
against it before anything in it is used, so a flipped bit is a refusal naming the file, never tokens;
`read_tokens` also checks every id against its modality's range (the last guard).
This is the only module that knows this layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from mmtok.errors import MmtokError
from mmtok.fsutil import atomic_write_bytes, sha256_file
from mmtok.vocab import VocabLayout, check_ids_in_range

CACHE_DIR = "audio-cache"
CACHE_FORMAT = "mmtok-audio-cache/2"  # /2: the source_sha256 column and the checksum file
METADATA_KEY = b"mmtok"
COLUMNS = ("cut_id", "source_id", "clip", "part", "position", "duration", "language", "target_language",
           "audio_ids", "text_ids", "source_sha256")
TOKEN_COLUMNS = ("audio_ids", "text_ids")
CHECKSUM_SUFFIX = ".sha256"
RERUN = "re-encode it: delete this output's parts/ and audio-cache/ and rerun `mmtok encode --modality audio`"


def cache_path(out: str | os.PathLike, part: int) -> Path:
    return Path(out) / CACHE_DIR / f"part-{part:05d}.parquet"


def _schema(metadata: dict):
    import pyarrow as pa

    fields = [("cut_id", pa.string()), ("source_id", pa.string()), ("clip", pa.int64()), ("part", pa.int32()),
              ("position", pa.int32()), ("duration", pa.float64()), ("language", pa.string()),
              ("target_language", pa.string()), ("audio_ids", pa.list_(pa.int32())), ("text_ids", pa.list_(pa.int32())),
              ("source_sha256", pa.string())]
    return pa.schema(fields, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})


def cache_verified_files(path: Path) -> list[Path]:
    """The files `verify` reads: cache part `path` and its checksum file."""
    return [path, checksum_path(path)]


def checksum_path(path: Path) -> Path:
    """The file holding the sha256 of cache part `path` (`sha256sum` format)."""
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def write_cache(path: Path, rows: list[dict], metadata: dict) -> None:
    """Atomically write one part's cache, then its checksum file; `rows` carry the COLUMNS keys, in cut
    order. A kill between the two leaves a part that `find_cache_parts` refuses until the writer reruns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema(metadata)
    columns = {name: [row.get(name) if name == "source_sha256" else row[name] for row in rows] for name in COLUMNS}
    table = pa.Table.from_pydict(columns, schema=schema)
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression="zstd")
    data = buffer.getvalue().to_pybytes()
    atomic_write_bytes(path, data)
    atomic_write_bytes(checksum_path(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())


def recorded_sha256(path: Path) -> str:
    """The sha256 that cache part `path`'s checksum file records (what `verify` checks the bytes against, so
    a reader that verified the part can name it without hashing it again)."""
    try:
        return checksum_path(path).read_text(encoding="ascii").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise MmtokError(f"{path}: no readable checksum file {checksum_path(path).name} (an older mmtok's cache, "
                         f"before {CACHE_FORMAT}, or an incomplete copy); {RERUN}") from None


def verify(path: Path) -> str:
    """The sha256 of cache part `path`, once it matches its checksum file; MmtokError naming the file otherwise."""
    recorded = recorded_sha256(path)
    digest = sha256_file(path)
    if digest != recorded:
        raise MmtokError(f"{path}: its bytes do not match {checksum_path(path).name} (bit rot, a damaged copy or "
                         f"a changed file); {RERUN}")
    return digest


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Any failure of pyarrow to read a (verified) part as one MmtokError naming it."""
    try:
        yield
    except MmtokError:
        raise
    except Exception as err:  # pyarrow raises many types (ArrowInvalid, OSError, ...) for files it cannot read
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise MmtokError(f"{path}: not a readable audio token cache ({message[:200]}); {RERUN}") from None


def read_metadata(path: Path) -> dict:
    import pyarrow.parquet as pq

    with _reading(path):
        raw = pq.read_schema(path).metadata or {}
        metadata = json.loads(raw[METADATA_KEY]) if METADATA_KEY in raw else None
    if not isinstance(metadata, dict):
        raise MmtokError(f"{path}: not an mmtok audio token cache (no `mmtok` metadata)")
    if metadata.get("format") != CACHE_FORMAT:
        raise MmtokError(f"{path}: an audio token cache of format {metadata.get('format')!r}, this mmtok reads "
                         f"{CACHE_FORMAT}; {RERUN}")
    return metadata


def read_cache_index(path: Path):
    """The cache's small columns (no token lists) as a pyarrow Table, plus the token-list lengths."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with _reading(path):
        table = pq.read_table(path, columns=[c for c in COLUMNS if c not in TOKEN_COLUMNS])
        lists = pq.read_table(path, columns=list(TOKEN_COLUMNS))
        text_lengths = pc.fill_null(pc.list_value_length(lists.column("text_ids")), -1)
        return (table.append_column("audio_length", pc.list_value_length(lists.column("audio_ids")))
                     .append_column("text_length", text_lengths))


def read_tokens(path: Path, layout: VocabLayout | None = None) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """(audio ids, text ids or None) per row of one part's cache; every audio id is checked to be an
    audio id of `layout` (default: the layout the file records) and every text id a text id
    (MmtokError naming the file otherwise)."""
    import pyarrow.parquet as pq

    layout = layout or VocabLayout(read_metadata(path)["vocab"]["text_size"])
    with _reading(path):
        table = pq.read_table(path, columns=list(TOKEN_COLUMNS))
        audio = [np.asarray(v, np.int32) for v in table.column("audio_ids").to_pylist()]
        text = [None if v is None else np.asarray(v, np.int32) for v in table.column("text_ids").to_pylist()]
    check_ids_in_range(np.concatenate(audio) if audio else np.zeros(0, np.int32), layout.audio_offset,
                       layout.total_size, f"{path}: audio ids")
    texts = [t for t in text if t is not None]
    check_ids_in_range(np.concatenate(texts) if texts else np.zeros(0, np.int32), 0, layout.text_size,
                       f"{path}: text ids")
    return audio, text


def find_cache_parts(out: str | os.PathLike, check_bytes: bool = True) -> list[Path]:
    """All cache parts 0..num_parts-1 of an encode output, each verified against its checksum file (unless
    `check_bytes` is False: for a caller that verifies them itself, or holds a record of these very files having been
    verified -- `mmtok sft`'s kept clip index); refuses a missing or damaged part or disagreeing metadata."""
    folder = Path(out) / CACHE_DIR
    paths = sorted(folder.glob("part-*.parquet"))
    if not paths:
        raise MmtokError(f"{folder}: no audio token cache; run `mmtok encode --modality audio --out {out}` first")
    check = verify if check_bytes else (lambda path: None)
    check(paths[0])
    first = read_metadata(paths[0])
    expected = [cache_path(out, part) for part in range(first["num_parts"])]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise MmtokError(f"{folder}: {len(missing)} of {len(expected)} parts are not encoded yet: "
                         f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}; finish every rank first")
    shared = {k: v for k, v in first.items() if k != "part"}
    for path in expected[1:]:
        check(path)
        other = {k: v for k, v in read_metadata(path).items() if k != "part"}
        if other != shared:
            raise MmtokError(f"{path}: made with different settings than {expected[0].name} "
                             "(codec, tokenizer or vocabulary); re-encode into one output directory")
    return expected
