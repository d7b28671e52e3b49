"""`mmtok dedup --report`: what a duplicate list drops, for a person to look at before any GPU sees the data.

Written into D/report/ (D the list's directory), report.json last:

  index.md                  the per-source counts (hashed = kept + duplicates + benchmark matches + caption-flagged;
                            matches held back), then each contact sheet with the rows it shows, as text (the
                            caption-flagged images with what was found and their caption's text)
  duplicates-<n>.png        per source, up to SAMPLED_GROUPS duplicate groups with a dropped image of that source
                            (a deterministic sample: evenly spaced over the groups in keeper order), one row each:
                            the keeper first, then the dropped copies with their rule and distance
  benchmark-matches.png     every benchmark match (up to MAX_MATCHES) beside the benchmark image it matched
  held.png                  every match held back as suspect (up to MAX_MATCHES) beside its benchmark image, with why
  captions-<rule>.png       per caption rule, up to CAPTION_EXAMPLES of its flagged images (evenly spaced in
                            source and row order)
  report.json               what was shown, and every image that could not be shown and why

Images are read from the manifests the hash tables name (recorded in dedup.json), checked against the scan's
identity of their tar first: an image whose tar changed since, that can no longer be read, or that does not
decode is a grey tile naming why (and listed in report.json `unshown`), never a crash of the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok import __version__
from mmtok.errors import MmtokError, Skip, brief
from mmtok.formats.dedup import BENCHMARK_RULE, CAPTION_RULES, LOCK_FILE, DedupList, DedupMetadata
from mmtok.fsutil import atomic_write_json, atomic_writer, refuse_foreign_output

REPORT_DIR = "report"
REPORT_FILE = "report.json"
FORMAT = "mmtok.dedup-report"
FORMAT_VERSION = 1
SAMPLED_GROUPS = 12  # duplicate groups shown per source
GROUP_MEMBERS = 6  # images shown per group (the keeper and the first dropped copies)
MAX_MATCHES = 200  # benchmark matches (and held matches) shown; the rest are counted
CAPTION_EXAMPLES = 24  # caption-flagged images shown per rule, with their captions
CAPTION_CHARS = 300  # of each caption quoted in index.md
TILES_PER_ROW = 6
TILE = 160  # pixels: each image fits a TILE x TILE square
LABEL = 28  # pixels of text under each tile
READ_COLUMNS = ("tar", "container", "member", "offset", "size", "status", "text_offset", "text_size")


@dataclass(frozen=True)
class Shown:
    """One tile: which image (its source and manifest row) and the label under it."""

    source: str
    row: int
    label: str
    caption: bool = False  # index.md quotes its caption

    def __post_init__(self):  # keys come from the data: a newline in one must not add lines to index.md
        object.__setattr__(self, "label", brief(self.label, 120))


def write_curation_report(out: Path) -> dict:
    """Write D/report/ for the duplicate list in `out` (`mmtok.formats.dedup`); returns report.json's content."""
    from mmtok.fsutil import WriterLock

    with WriterLock(out, f"the duplicate list in {out}", name=LOCK_FILE):  # one writer of the list and its report
        return _write(out)


def _write(out: Path) -> dict:
    import pyarrow.compute as pc

    listed = DedupList.open(out)
    directory = out / REPORT_DIR
    refuse_foreign_output(directory, ("index.md",), (REPORT_FILE,), "mmtok dedup --report",
                          (REPORT_FILE, FORMAT, FORMAT_VERSION, "duplicate-list report"))
    directory.mkdir(exist_ok=True)
    (directory / REPORT_FILE).unlink(missing_ok=True)
    images = _Images(listed.metadata)
    table, held = listed.table(), listed.held_table()
    matched = pc.equal(table.column("rule"), BENCHMARK_RULE)
    duplicates = table.filter(pc.greater_equal(table.column("group"), 0))
    sections, sheets = [], {}
    for number, source in enumerate(sorted(listed.metadata.counts)):
        rows = _sampled_groups(duplicates, source)
        if rows:
            name = f"duplicates-{number}.png"
            sheets[name] = rows
            sections.append((f"Duplicates of {source}: {len(rows)} of its groups, keeper first", name, rows))
    for title, name, chosen in (
            ("Benchmark matches (dropped), beside the benchmark image", "benchmark-matches.png", table.filter(matched)),
            ("Matches held back as suspect (kept), beside the benchmark image", "held.png", held)):
        if chosen is not None and chosen.num_rows:
            rows = [_match_row(r) for r in chosen.slice(0, MAX_MATCHES).to_pylist()]
            sheets[name] = rows
            sections.append((f"{title}: {len(rows):,} of {chosen.num_rows:,}", name, rows))
    for rule in CAPTION_RULES:
        flagged = table.filter(pc.equal(table.column("rule"), rule))
        if flagged.num_rows:
            picked = np.unique(np.linspace(0, flagged.num_rows - 1, min(CAPTION_EXAMPLES, flagged.num_rows))
                               .astype(np.int64))
            tiles = [Shown(r["source"], r["manifest_row"], f"{r['source']}:{r['key']} {r['detail']}", caption=True)
                     for r in flagged.take(picked).to_pylist()]
            rows = [tiles[i:i + TILES_PER_ROW] for i in range(0, len(tiles), TILES_PER_ROW)]
            sheets[f"captions-{rule}.png"] = rows
            sections.append((f"Flagged by {rule}: {len(tiles):,} of {flagged.num_rows:,}, with their captions",
                             f"captions-{rule}.png", rows))
    images.load(sheets)
    try:
        for name, rows in sheets.items():
            _write_sheet(directory / name, rows, images)
        quoted = {(t.source, t.row): images.caption(t) for rows in sheets.values() for row in rows for t in row
                  if t.caption}
    finally:
        images.close()
    with atomic_writer(directory / "index.md", "w") as handle:
        handle.write(_markdown(listed.metadata, sections, images.unshown, quoted))
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, "tool": f"mmtok {__version__}",
              "list_fingerprint": listed.metadata.fingerprint, "sheets": sorted(sheets),
              "shown": sum(len(row) for rows in sheets.values() for row in rows), "unshown": images.unshown}
    atomic_write_json(directory / REPORT_FILE, record)
    return record


def _sampled_groups(duplicates, source: str) -> list[list[Shown]]:
    """Up to SAMPLED_GROUPS groups with a dropped image of `source`, evenly spaced over its groups in keeper order;
    each the keeper, then its dropped copies (by source and row). Only the chosen groups become Python rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    groups = np.unique(duplicates.filter(pc.equal(duplicates.column("source"), source)).column("group").to_numpy())
    if not len(groups):
        return []
    picked = np.unique(groups[np.linspace(0, len(groups) - 1, min(SAMPLED_GROUPS, len(groups))).astype(np.int64)])
    members: dict[int, list[dict]] = {}
    for row in duplicates.filter(pc.is_in(duplicates.column("group"), pa.array(picked))).to_pylist():
        members.setdefault(row["group"], []).append(row)
    shown = []
    for group in picked.tolist():
        rows = sorted(members[group], key=lambda r: (r["source"], r["manifest_row"]))
        keeper = rows[0]
        tiles = [Shown(keeper["keeper_source"], keeper["keeper_row"],
                       f"keeper {keeper['keeper_source']}:{keeper['keeper_key']}")]
        tiles += [Shown(m["source"], m["manifest_row"], f"{m['source']}:{m['key']} {m['rule']} d={m['distance']}")
                  for m in rows[:GROUP_MEMBERS - 1]]
        shown.append(tiles)
    return shown


def _match_row(row: dict) -> list[Shown]:
    """A training image beside the benchmark image it matched (dropped.parquet's keeper columns, or held.parquet's
    bench columns)."""
    bench = ("keeper_source", "keeper_row", "keeper_key") if "keeper_source" in row else \
        ("bench_source", "bench_row", "bench_key")
    why = f" ({row['why']})" if row.get("why") else ""
    return [Shown(row["source"], row["manifest_row"], f"{row['source']}:{row['key']} d={row['distance']}{why}"),
            Shown(row[bench[0]], row[bench[1]], f"benchmark {row[bench[0]]}:{row[bench[2]]}")]


class _Images:
    """Thumbnails of manifest rows, read through the manifests the list's hash tables name."""

    def __init__(self, metadata: DedupMetadata):
        from mmtok.formats.hashes import HashTable

        self.manifests = {entry.source: entry.manifest_directory for entry in metadata.inputs}
        for bench in metadata.decontamination.against if metadata.decontamination else []:
            try:
                self.manifests[bench.benchmark] = HashTable.open(bench.hashes).metadata.manifest.directory
            except MmtokError:
                self.manifests[bench.benchmark] = None  # its images are shown as unavailable
        self.unshown: list[dict] = []
        self._rows: dict[tuple[str, int], dict] = {}  # (source, manifest row) -> its READ_COLUMNS
        self._missing: dict[str, Skip] = {}  # sources whose manifest cannot be opened
        self._stale: dict[str, str | None] = {}  # tar -> how it changed since its scan (None: unchanged)
        self._manifests: dict[str, object] = {}
        self._reader = None

    def load(self, sheets: dict[str, list[list[Shown]]]) -> None:
        """Read the manifest columns of every tile's row: one read per source, not one per tile."""
        from mmtok.formats.manifest import MemberReader

        wanted: dict[str, set[int]] = {}
        for rows in sheets.values():
            for tile in (tile for row in rows for tile in row):
                wanted.setdefault(tile.source, set()).add(int(tile.row))
        for source, rows in sorted(wanted.items()):
            try:
                manifest = self._manifest(source)
            except Skip as skip:
                self._missing[source] = skip
                continue
            ordered = np.array(sorted(rows), np.int64)
            columns = manifest.read_rows(ordered, READ_COLUMNS)
            for i, row in enumerate(ordered.tolist()):
                self._rows[(source, row)] = {name: columns[name][i] for name in READ_COLUMNS}
        self._reader = MemberReader(max_open=16)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def thumbnail(self, shown: Shown):
        """The image, fitted into TILE x TILE; a grey tile naming why it cannot be shown."""
        try:
            image = self._decode(shown)
        except Skip as skip:
            self.unshown.append({"source": shown.source, "manifest_row": int(shown.row), "reason": skip.reason,
                                 "detail": skip.detail[:300]})
            return _placeholder(f"{skip.reason}")
        image.thumbnail((TILE, TILE))
        return image

    def caption(self, shown: Shown) -> str:
        """The first CAPTION_CHARS of the image's caption, or why it cannot be shown (in brackets)."""
        from mmtok.formats.manifest import ShortRead

        try:
            r = self._checked(shown)
            offset, size = int(r["text_offset"]), int(r["text_size"])
            if offset < 0 or size < 0:
                return "[no caption]"
            manifest = self._manifests[shown.source]
            data = self._reader.read_text(str(r["container"]), str(r["tar"]), offset, min(size, 4 * CAPTION_CHARS),
                                          manifest.text_column)
        except Skip as skip:
            return f"[{skip.reason}]"
        except (ShortRead, OSError) as err:
            return f"[caption_unreadable: {brief(str(err), 80)}]"
        return data.decode("utf-8", errors="replace")[:CAPTION_CHARS]

    def _checked(self, shown: Shown) -> dict:
        """The row's manifest columns, after checking its tar is the one scanned (Skip when not)."""
        if shown.source in self._missing:
            raise self._missing[shown.source]
        r = self._rows[(shown.source, int(shown.row))]
        path = str(r["tar"])
        if path not in self._stale:
            self._stale[path] = self._changed(self._manifests[shown.source], path)
        if self._stale[path]:
            raise Skip("stale_media", f"{path} changed since the scan ({self._stale[path]})")
        return r

    def _decode(self, shown: Shown):
        from mmtok.formats.manifest import ShortRead
        from mmtok.media.images import decode_rgb

        r = self._checked(shown)
        path = str(r["tar"])
        try:
            data = self._reader.read_member(str(r["container"]), path, str(r["member"]), int(r["offset"]),
                                            int(r["size"]))
        except ShortRead as err:
            raise Skip("short_read", str(err)) from None
        except OSError as err:
            raise Skip("read_error", f"{path}: {err}") from None
        return decode_rgb(data)

    def _manifest(self, source: str):
        from mmtok.formats.manifest import Manifest

        directory = self.manifests.get(source)
        if directory is None:
            raise Skip("missing_media", f"no manifest of {source} is recorded")
        try:
            self._manifests[source] = Manifest.open(Path(directory))
        except (MmtokError, OSError) as err:
            raise Skip("missing_media", f"the manifest of {source} ({directory}) cannot be opened: {err}") from None
        return self._manifests[source]

    @staticmethod
    def _changed(manifest, path: str) -> str | None:
        from mmtok.formats.manifest import identity_change

        try:
            return identity_change(path, manifest.identities([path])[path])
        except MmtokError as err:  # no identity recorded: its bytes cannot be trusted to be the scanned ones
            return str(err)


def _placeholder(text: str):
    from PIL import Image, ImageDraw

    tile = Image.new("RGB", (TILE, TILE), (128, 128, 128))
    ImageDraw.Draw(tile).text((6, TILE // 2 - 6), text[:24], fill=(255, 255, 255))
    return tile


def _write_sheet(path: Path, rows: list[list[Shown]], images: _Images) -> None:
    """One row of tiles per entry, each labelled (PNG, written atomically)."""
    from PIL import Image, ImageDraw

    width = max(len(row) for row in rows) * (TILE + 8) + 8
    sheet = Image.new("RGB", (width, len(rows) * (TILE + LABEL + 8) + 8), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for y, row in enumerate(rows):
        for x, shown in enumerate(row):
            left, top = 8 + x * (TILE + 8), 8 + y * (TILE + LABEL + 8)
            tile = images.thumbnail(shown)
            sheet.paste(tile, (left + (TILE - tile.width) // 2, top + (TILE - tile.height) // 2))
            for line, text in enumerate((shown.label[:26], shown.label[26:52])):
                draw.text((left, top + TILE + 2 + 12 * line), text, fill=(0, 0, 0))
    with atomic_writer(path) as handle:
        sheet.save(handle, "PNG")


def _markdown(metadata: DedupMetadata, sections: list, unshown: list[dict], quoted: dict) -> str:
    """index.md: the counts table (it adds up), then each sheet and its rows as text (a caption-flagged image
    with its caption, escaped: a caption is a stranger's text and must not become markup)."""
    lines = ["# What the duplicate list drops", "", f"{metadata.dropped:,} images dropped; list "
             f"`dropped.parquet` (sha256 {metadata.fingerprint[:12]}...).", "",
             "| source | hashed | kept | duplicates | benchmark matches | caption-flagged | held back (kept) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for source, counts in sorted(metadata.counts.items()):
        matches = counts.by_rule.get("benchmark", 0)
        flagged = sum(counts.by_rule.get(rule, 0) for rule in CAPTION_RULES)
        lines.append(f"| {source} | {counts.hashed:,} | {counts.kept:,} | "
                     f"{counts.dropped - matches - flagged:,} | {matches:,} | {flagged:,} | {counts.held:,} |")
    lines += ["", "hashed = kept + duplicates + benchmark matches + caption-flagged; held-back matches are among the "
              "kept.", ""]
    for title, name, rows in sections:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
        for row in rows:
            if row and row[0].caption:
                lines += [f"- {_escaped(tile.label)}: {_escaped(quoted[(tile.source, tile.row)])}" for tile in row]
            else:
                lines.append(" | ".join(tile.label for tile in row))
        lines.append("")
    if unshown:
        lines += ["## Images that could not be shown", ""]
        lines += [f"- {u['source']} row {u['manifest_row']}: {u['reason']} -- {brief(u['detail'])}" for u in unshown]
    return "\n".join(lines) + "\n"


def _escaped(text: str) -> str:
    """A caption as one line of literal text in markdown: control characters and newlines as spaces, every
    character markdown or HTML would read escaped."""
    import re
    import unicodedata

    text = "".join(" " if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in text)
    return re.sub(r"([\\`*_{}\[\]()<>#!|~&])", r"\\\1", brief(text, CAPTION_CHARS))
