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

The file's key-value metadata `mmtok` holds JSON: part, num_parts, vocabulary layout, text
tokenizer, codec description and the trim rule, so a reader can check that all parts agree.
This is the only module that knows this layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.fsutil import atomic_writer

CACHE_DIR = "audio-cache"
METADATA_KEY = b"mmtok"
COLUMNS = ("cut_id", "source_id", "clip", "part", "position", "duration", "language", "target_language",
           "audio_ids", "text_ids")


def cache_path(out: str | os.PathLike, part: int) -> Path:
    return Path(out) / CACHE_DIR / f"part-{part:05d}.parquet"


def _schema(metadata: dict):
    import pyarrow as pa

    fields = [("cut_id", pa.string()), ("source_id", pa.string()), ("clip", pa.int64()), ("part", pa.int32()),
              ("position", pa.int32()), ("duration", pa.float64()), ("language", pa.string()),
              ("target_language", pa.string()), ("audio_ids", pa.list_(pa.int32())), ("text_ids", pa.list_(pa.int32()))]
    return pa.schema(fields, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})


def write_cache(path: Path, rows: list[dict], metadata: dict) -> None:
    """Atomically write one part's cache; `rows` carry the COLUMNS keys, in cut order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema(metadata)
    columns = {name: [row[name] for row in rows] for name in COLUMNS}
    table = pa.Table.from_pydict(columns, schema=schema)
    with atomic_writer(path) as handle:
        pq.write_table(table, handle, compression="zstd")


def read_metadata(path: Path) -> dict:
    import pyarrow.parquet as pq

    raw = pq.read_schema(path).metadata or {}
    if METADATA_KEY not in raw:
        raise MmtokError(f"{path}: not an mmtok audio token cache (no `mmtok` metadata)")
    return json.loads(raw[METADATA_KEY])


def read_index(path: Path):
    """The cache's small columns (no token lists) as a pyarrow Table, plus the token-list lengths."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=[c for c in COLUMNS if c not in ("audio_ids", "text_ids")])
    lists = pq.read_table(path, columns=["audio_ids", "text_ids"])
    text_lengths = pc.fill_null(pc.list_value_length(lists.column("text_ids")), -1)
    return (table.append_column("audio_length", pc.list_value_length(lists.column("audio_ids")))
                 .append_column("text_length", text_lengths))


def read_tokens(path: Path) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """(audio ids, text ids or None) per row of one part's cache."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["audio_ids", "text_ids"])
    audio = [np.asarray(v, np.int32) for v in table.column("audio_ids").to_pylist()]
    text = [None if v is None else np.asarray(v, np.int32) for v in table.column("text_ids").to_pylist()]
    return audio, text


def find_parts(out: str | os.PathLike) -> list[Path]:
    """All cache parts 0..num_parts-1 of an encode output; refuses a missing part or disagreeing metadata."""
    folder = Path(out) / CACHE_DIR
    paths = sorted(folder.glob("part-*.parquet"))
    if not paths:
        raise MmtokError(f"{folder}: no audio token cache; run `mmtok encode --modality audio --out {out}` first")
    first = read_metadata(paths[0])
    expected = [cache_path(out, part) for part in range(first["num_parts"])]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise MmtokError(f"{folder}: {len(missing)} of {len(expected)} parts are not encoded yet: "
                         f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}; finish every rank first")
    shared = {k: v for k, v in first.items() if k != "part"}
    for path in expected[1:]:
        other = {k: v for k, v in read_metadata(path).items() if k != "part"}
        if other != shared:
            raise MmtokError(f"{path}: made with different settings than {expected[0].name} "
                             "(codec, tokenizer or vocabulary); re-encode into one output directory")
    return expected
