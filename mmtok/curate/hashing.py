"""`mmtok hash`: the pHash and sha256 of every image of a manifest, in fixed chunks any rank may take.

The manifest's rows are cut into chunks of `chunk_rows` rows (`mmtok hash --chunk-rows`); chunk c belongs
first to rank c % world_size, and a rank that has finished its own takes over, from the far end, the chunks
no other process has claimed (a slow or dead rank's). Each chunk is hashed under its claim (a `WriterLock` on
its own lock file, dropped by the kernel when its holder dies) and committed with a checksum, so a rerun after
kill -9 redoes only the chunks that were not committed. Whoever finds every chunk committed writes the table,
from the chunks alone and in chunk order: the bytes depend on the manifest, never on the world size, the
workers or the kills.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from mmtok.curate import captions
from mmtok.curate.phash import ALGORITHM, image_hashes
from mmtok.errors import MmtokError, Skip
from mmtok.formats import hashes as fmt
from mmtok.formats.manifest import Manifest, MemberReader, ShortRead, identity_change, stale_detail
from mmtok.formats.scan_shards import read_commit, read_rows, write_shard_rows
from mmtok.fsutil import LockHeld, WriterLock

READ_COLUMNS = ("key", "document", "tar", "container", "member", "offset", "size", "status", "width", "height",
                "text_offset", "text_size")


@dataclass(frozen=True)
class HashShare:
    """What one rank of `mmtok hash` did: the chunks it hashed (its own and those `taken_over` from other ranks)
    and their images, the chunks no process has committed yet (`left`), and the table's metadata (hashes.json)
    when this rank wrote it."""

    rank: int
    world_size: int
    chunks: int
    hashed_chunks: int
    taken_over: int
    images: int
    seconds: float
    workers: int
    left: int
    table: fmt.HashMetadata | None


def hash_manifest(manifest_dir: str | Path, out: Path, source: str | None, rank: int, world_size: int,
                  workers: int, chunk_rows: int, progress: bool = True,
                  fragments: captions.Fragments | None = None) -> HashShare:
    """Hash this rank's chunks, then any chunk nobody claimed; when every chunk is committed, write the table
    (`mmtok.formats.hashes`). Each row also gets its caption's measures (`mmtok.curate.captions`; `fragments`:
    the prompt fragments to look for). Returns what this rank did and, under `table`, the table's metadata when
    it wrote it (None when other ranks still work). Every rank of a job must be given the same `chunk_rows` and
    fragments."""
    if chunk_rows < 1:
        raise MmtokError(f"--chunk-rows must be at least 1, got {chunk_rows}")
    fmt.check_output(out)
    manifest = Manifest.open(Path(manifest_dir).resolve())
    fingerprint = manifest.verify()
    # chunks of other caption checks or fragments are never reused
    checks = f"{ALGORITHM}-c{captions.CHECKS_VERSION}-{_fragments_digest(fragments)[:12]}-{chunk_rows}"
    cache = fmt.cache_dir(out, checks, fingerprint)
    cache.mkdir(parents=True, exist_ok=True)
    count = max(1, -(-manifest.num_rows // chunk_rows))
    own = [c for c in range(count) if c % world_size == rank]
    others = [c for c in reversed(range(count)) if c % world_size != rank]
    # verified: a chunk whose bytes no longer match its commit (a damaged disk, an edit) is hashed again
    todo = [c for c in own + others if read_commit(fmt.chunk_path(cache, c), verify=True) is None]
    began = time.perf_counter()
    done = _hash_chunks(manifest, cache, todo, workers, progress, count, chunk_rows, fragments)
    seconds = time.perf_counter() - began
    left = sum(read_commit(fmt.chunk_path(cache, c), verify=False) is None for c in range(count))
    table = None
    if not left:
        try:
            table = _write_table(manifest, out, cache, count, source or _source_name(manifest), fragments)
        except LockHeld:  # another rank that finished at the same time writes the same bytes
            pass
    return HashShare(rank=rank, world_size=world_size, chunks=count, hashed_chunks=len(done),
                     taken_over=len(set(done) - set(own)), images=sum(done.values()), seconds=seconds,
                     workers=workers, left=left, table=table)


def _fragments_digest(fragments: captions.Fragments | None) -> str:
    import hashlib
    import json

    lines = fragments.lines if fragments else []
    return hashlib.sha256(json.dumps(lines, ensure_ascii=False).encode("utf-8")).hexdigest()


def _source_name(manifest: Manifest) -> str:
    """The source a manifest is when `--source` names none: its folder's name."""
    return manifest.directory.name


def _hash_chunks(manifest: Manifest, cache: Path, todo: list[int], workers: int, progress: bool,
                 count: int, chunk_rows: int, fragments: captions.Fragments | None) -> dict[int, int]:
    """Hash and commit the chunks `todo` that no other process claims; returns chunk -> images hashed."""
    from mmtok.progress import progress as progress_bar

    identities = manifest.identities(_containers(manifest))
    done: dict[int, int] = {}
    bar = progress_bar(total=count, initial=count - len(todo), unit="chunk", desc="hash", enabled=progress)
    with bar:
        for chunk, images in _run(manifest.directory, cache, todo, identities, workers, chunk_rows, fragments):
            if images is not None:
                done[chunk] = images
            bar.update(1)
            bar.set_postfix(images=sum(done.values()), refresh=False)
    return done


def _containers(manifest: Manifest) -> list[str]:
    return sorted({entry.path for entry in manifest.metadata.inputs})


def _run(manifest_dir: Path, cache: Path, todo: list[int], identities: dict, workers: int, chunk_rows: int,
         fragments: captions.Fragments | None) -> Iterator[tuple[int, int | None]]:
    if workers <= 1 or len(todo) <= 1:
        for chunk in todo:
            yield chunk, _claimed(str(manifest_dir), cache, chunk, identities, chunk_rows, fragments)
        return
    with ProcessPoolExecutor(max_workers=min(workers, len(todo))) as pool:
        futures = [(chunk, pool.submit(_claimed, str(manifest_dir), cache, chunk, identities, chunk_rows, fragments))
                   for chunk in todo]
        for chunk, future in futures:  # in submission order: a chunk is short, the bar stays honest
            yield chunk, future.result()


def _claimed(manifest_dir: str, cache: Path, chunk: int, identities: dict, chunk_rows: int,
             fragments: captions.Fragments | None) -> int | None:
    """Hash and commit one chunk under its claim; None when another process holds the claim or committed it."""
    path = fmt.chunk_path(cache, chunk)
    try:
        claim = WriterLock(cache, f"hash chunk {chunk}", name=f".chunk-{chunk:08d}.lock")
    except LockHeld:
        return None
    with claim:
        if read_commit(path, verify=True) is not None:
            return None
        for stale in cache.glob(f".{path.name}.tmp-*"):  # a killed holder's unfinished writes
            stale.unlink(missing_ok=True)
        table = hash_chunk(Manifest.open(manifest_dir), chunk * chunk_rows, chunk_rows, identities, fragments)
        write_shard_rows(path, table, {"chunk": chunk, "rows": table.num_rows}, retry=False)
        return int(sum(1 for reason in table.column("reason").to_pylist() if not reason))


def hash_chunk(manifest: Manifest, start: int, chunk_rows: int, identities: dict,
               fragments: captions.Fragments | None = None) -> pa.Table:
    """The image rows [start, start + chunk_rows) hashed, with their captions' measures (CHUNK_SCHEMA): a row
    that cannot be hashed carries its skip instead. The manifest's error rows are left out (the manifest names
    them)."""
    stop = min(start + chunk_rows, manifest.num_rows)
    rows = np.arange(start, stop, dtype=np.int64)
    r = manifest.read_rows(rows, READ_COLUMNS)
    ok = np.flatnonzero(r["status"] == "ok")
    stale = {path: identity_change(path, identities[path]) if path in identities else "no identity recorded"
             for path in set(r["tar"][ok].tolist())}
    reader = MemberReader(max_open=16)
    hashed, measured = [], []
    last: tuple = (None, None)  # the images of one document share its caption: read once
    try:
        for i in ok:
            phash, digest, skip = _hash_row(reader, r, int(i), stale)
            hashed.append((phash, digest, skip.reason if skip else "", skip.detail if skip else ""))
            where = (r["tar"][i], int(r["text_offset"][i]))
            if where != last[0]:
                last = (where, _caption(reader, r, int(i), stale, manifest.text_column, fragments))
            measured.append(last[1])
    finally:
        reader.close()
    phash, digest, reason, detail = zip(*hashed, strict=True) if hashed else ((), (), (), ())
    pixels = np.maximum(r["width"][ok].astype(np.int64), 0) * np.maximum(r["height"][ok].astype(np.int64), 0)
    columns = {f"caption_{name}": [getattr(m, name) for m in measured] for name in fmt.CAPTION_MEASURES}
    return pa.table({"manifest_row": rows[ok], "key": r["key"][ok], "document": r["document"][ok],
                     "phash": list(phash), "sha256": list(digest),
                     "pixels": pixels, **columns, "reason": list(reason), "detail": list(detail),
                     "source": r["tar"][ok], "container": r["container"][ok], "member": r["member"][ok]},
                    schema=fmt.CHUNK_SCHEMA)


def _caption(reader: MemberReader, r: dict, i: int, stale: dict, text_column: str | None,
             fragments: captions.Fragments | None) -> captions.Measures:
    """The measures of row i's caption (its first MAX_CAPTION_BYTES); a caption that cannot be read is counted
    as such, and costs the row nothing else."""
    offset, size = int(r["text_offset"][i]), int(r["text_size"][i])
    if offset < 0 or size < 0:
        return captions.Measures(words=captions.NO_CAPTION)
    if stale.get(r["tar"][i]):  # its offsets describe other bytes now
        return captions.Measures(words=captions.UNREADABLE)
    container = r["container"][i]
    try:
        data = reader.read_text(container, r["tar"][i], offset, min(size, captions.MAX_CAPTION_BYTES), text_column)
    except (ShortRead, OSError, ValueError):
        return captions.Measures(words=captions.UNREADABLE)
    truncated = size > captions.MAX_CAPTION_BYTES or len(data) > captions.MAX_CAPTION_BYTES
    return captions.measure(data[:captions.MAX_CAPTION_BYTES], truncated, fragments)


def _hash_row(reader: MemberReader, r: dict, i: int, stale: dict) -> tuple[int, bytes, Skip | None]:
    """(pHash, sha256, None) of row i, or (0, 32 zero bytes, the skip): bad bytes and failed reads cost the row,
    not the run (a missing input stays an error of the run: its fix is to restore it)."""
    try:
        change = stale.get(r["tar"][i])
        if change:  # its offsets describe other bytes now: nothing of it is read
            raise Skip("stale_media", stale_detail(r["tar"][i], change))
        data = reader.read_member(r["container"][i], r["tar"][i], r["member"][i], int(r["offset"][i]),
                                  int(r["size"][i]))
        phash, digest = image_hashes(data)
        return phash, digest, None
    except Skip as skip:  # ImageDecodeError included
        return 0, bytes(32), skip
    except ShortRead as err:
        return 0, bytes(32), Skip("short_read", str(err))
    except (OSError, ValueError) as err:  # EIO from a bad sector, EINVAL from a damaged offset
        detail = f"{r['tar'][i]}: {r['member'][i]} at offset {int(r['offset'][i])}: {err}"
        return 0, bytes(32), Skip("read_error", detail)


def _write_table(manifest: Manifest, out: Path, cache: Path, count: int, source: str,
                 fragments: captions.Fragments | None) -> dict:
    """Assemble the table from the committed chunks (each verified by its sha256 first)."""
    with WriterLock(out, f"the hash table in {out}"):
        paths = [fmt.chunk_path(cache, c) for c in range(count)]
        for path in paths:
            if read_commit(path, verify=True) is None:
                raise MmtokError(f"{path} does not match its commit (changed or damaged since it was written); "
                                 f"remove it and rerun `mmtok hash` (it hashes that chunk again)")
        tables = [read_rows(path) for path in paths]
        reasons: dict[str, int] = {}
        for table in tables:
            for reason in table.column("reason").to_pylist():
                if reason:
                    reasons[reason] = reasons.get(reason, 0) + 1
        scanned_errors = manifest.num_rows - sum(t.num_rows for t in tables)
        meta = fmt.HashMetadata(
            algorithm=ALGORITHM, source=source, captions=_captions_record(tables, fragments),
            manifest=fmt.HashedManifest(str(manifest.directory), manifest.fingerprint, manifest.num_rows),
            counts=fmt.HashCounts(manifest.num_rows, scanned_errors, dict(sorted(reasons.items()))))
        return fmt.write_hashes(out, tables, meta)


def _captions_record(tables: list[pa.Table], fragments: captions.Fragments | None) -> fmt.CaptionChecks:
    """What hashes.json records of the caption checks: their version, the fragments looked for, and how many of
    the hashed rows had a caption checked, and why the others had none."""
    import pyarrow.compute as pc

    counts = {"checked": 0, **{name: 0 for name in captions.UNCHECKED.values()}}
    for table in tables:
        words = table.filter(pc.equal(table.column("reason"), "")).column("caption_words").to_numpy()
        counts["checked"] += int((words >= 0).sum())
        for code, name in captions.UNCHECKED.items():
            counts[name] += int((words == code).sum())
    return fmt.CaptionChecks(checks=captions.CHECKS_VERSION, max_bytes=captions.MAX_CAPTION_BYTES,
                             fragments=list(fragments.lines) if fragments else [], counts=counts)
