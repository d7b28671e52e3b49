"""`mmtok dedup`: duplicate groups over the hash tables of several sources, one keeper each, by sample id.

Two images are duplicates when their bytes are equal (always, whatever the policy), or when their pHashes are
within the radius both of their sources' rules allow (`exact`: radius 0, `radius`: r, `off`: never by pHash).
A group is a connected set of such pairs (so a chain a~b~c is one group even where a and c are farther apart).
Its keeper is the image first in KEEPER_ORDER (source priority, then the most pixels, source name, sample key,
manifest row): a rule on the images alone, so the result depends on neither the order of the inputs nor how the
hashes were computed.

Everything is sorting in NumPy: equal bytes and equal pHashes are runs of a sort; pHashes within a radius come
from `mmtok.curate.search.pairs_within` (exact, sub-quadratic); groups are the connected components of the
pairs (SciPy's csgraph), over the few images that have a duplicate at all.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from mmtok.errors import MmtokError, brief

if TYPE_CHECKING:  # the list's types; pyarrow is imported when a list is made
    from mmtok.formats.dedup import DecontaminationRecord, DedupMetadata, SourceCounts

RULE_RADIUS = {"exact": 0, "off": -1}  # a rule's pHash radius; `radius` takes the policy's `radius: r`
MAX_RADIUS = 16  # 1/4 of the bits: past this a pHash matches unrelated images, and the search slows down
# Radius to benchmark images: 10^8 images against 10^6 take minutes at 4, hours past 8 (the tables grow as C(b, r)).
MAX_BENCH_RADIUS = 8
MAX_PRIORITY = 10**9  # priorities are sorted as int64
# The keeper of a group is the image first in this order: not dropped as a benchmark match (`--against`: a group
# keeps an image that stays when it has one), the policy's priority, then the largest image (a
# thumbnail that the plan would drop as too small never wins over its full-size copy), the source name, the
# sample key (as UTF-8 bytes), the manifest row (images of one sample).
# How policy values are quoted in errors: a few levels and items, so a YAML alias bomb is never expanded.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 4, 4, 60, 60
KEEPER_ORDER = [("matched", "ascending"), ("priority", "ascending"), ("pixels", "descending"),
                ("source", "ascending"), ("key", "ascending"), ("row", "ascending")]
POLICY_KEYS = {"rule", "radius", "priority", "decontaminate", "captions"}


def _listed_schema():
    import pyarrow as pa

    from mmtok.formats.dedup import SCHEMA

    return pa.schema([("index", pa.int64()), *SCHEMA])  # dropped.parquet's rows and each image's global index


@dataclass(frozen=True)
class SourceRule:
    """How one source is deduplicated: its pHash radius (-1: off, 0: exact) and its keeper priority (lower wins);
    and decontaminated (`--against`): its pHash radius to benchmark images (-1: off; None: the policy's default,
    `mmtok.curate.decontaminate.Guards.radius`); and whether its captions are checked (`captions: off`: not)."""

    radius: int
    priority: int
    decontaminate: int | None = None
    captions: bool = True

    @property
    def rule(self) -> str:
        return {-1: "off", 0: "exact"}.get(self.radius, "radius")


def load_policy(path: str | Path) -> tuple[dict[str, SourceRule], dict, dict]:
    """The policy file: `sources:` mapping each source name to {rule: exact|radius|off, radius: r (with rule
    radius), priority: n (default: its position in the file), decontaminate: r|off, captions: off (optional)},
    and optionally `decontamination:` (the guards of `--against`: `mmtok.curate.decontaminate.Guards`) and
    `captions:` (`mmtok.curate.captions.Thresholds`); returns the rules and those two mappings as written.
    MmtokError naming the entry for anything else (values are quoted through `_SHOWN`: a YAML alias bomb must not
    be expanded into the message)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise MmtokError(f"cannot read the policy {path}: {brief(str(err).splitlines()[0])}") from None
    if not isinstance(data, dict) or not {"sources"} <= set(data) <= {"sources", "decontamination", "captions"} \
            or not isinstance(data["sources"], dict) or not data["sources"]:
        raise MmtokError(f"{path}: a policy is a mapping `sources:` of source name -> {{rule, radius, priority, "
                         "decontaminate, captions}, and optionally `decontamination:` and `captions:` "
                         "(docs/curation.md)")
    names = [name for name in data["sources"] if not isinstance(name, str) or not name]
    if names:
        raise MmtokError(f"{path}: source names are non-empty strings (quote them), got {_SHOWN.repr(names[0])}")
    rules = {name: _source_rule(path, name, entry, position)
             for position, (name, entry) in enumerate(data["sources"].items())}
    guards = data.get("decontamination", {})
    if not isinstance(guards, dict):
        raise MmtokError(f"{path}: `decontamination:` is a mapping of radius, max_matches, max_share, min_flagged "
                         f"(docs/curation.md), got {_SHOWN.repr(guards)}")
    return rules, guards, data.get("captions", {})


def _source_rule(path, name: str, entry, position: int) -> SourceRule:
    where = f"{path}: source {_SHOWN.repr(name)}"
    if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry) or not set(entry) <= POLICY_KEYS \
            or "rule" not in entry:
        raise MmtokError(f"{where}: give a mapping with `rule` (exact, radius or off) and optionally `radius`, "
                         f"`priority`; got {_SHOWN.repr(entry)}")
    rule, radius = _off(entry["rule"]), entry.get("radius")
    if rule == "radius":
        if not _integer(radius) or not 1 <= radius <= MAX_RADIUS:
            raise MmtokError(f"{where}: rule radius needs `radius:` an integer 1..{MAX_RADIUS}, got "
                             f"{_SHOWN.repr(radius)}")
    elif isinstance(rule, str) and rule in RULE_RADIUS:
        if radius is not None:
            raise MmtokError(f"{where}: `radius` goes with rule radius, not {rule}")
        radius = RULE_RADIUS[rule]
    else:
        raise MmtokError(f"{where}: unknown rule {_SHOWN.repr(rule)} (known: exact, radius, off)")
    priority = entry.get("priority", position)
    if not _integer(priority) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise MmtokError(f"{where}: `priority` must be an integer in -{MAX_PRIORITY:,}..{MAX_PRIORITY:,}, got "
                         f"{_SHOWN.repr(priority)}")
    decontaminate = _off(entry.get("decontaminate"))
    if decontaminate == "off":
        decontaminate = -1
    elif decontaminate is not None and (not _integer(decontaminate) or not 0 <= decontaminate <= MAX_BENCH_RADIUS):
        raise MmtokError(f"{where}: `decontaminate` is a pHash radius 0..{MAX_BENCH_RADIUS} to benchmark images, or "
                         f"off; got {_SHOWN.repr(decontaminate)}")
    captions = _off(entry.get("captions", "on"))
    if captions not in ("on", "off"):
        raise MmtokError(f"{where}: `captions` is on or off (whether its captions are checked), got "
                         f"{_SHOWN.repr(captions)}")
    return SourceRule(radius=radius, priority=priority, decontaminate=decontaminate, captions=captions == "on")


def _off(value):
    """`off` and `on` as YAML 1.1 reads them unquoted (False, True) are the words."""
    return "off" if value is False else "on" if value is True else value


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Duplicates:
    """The images that are not keepers, aligned: their index, their keeper's, their group (numbered in keeper
    order), the rule that makes them the keeper's duplicate (mmtok.formats.dedup.RULES) and the pHash distance."""

    dropped: np.ndarray
    keeper: np.ndarray
    group: np.ndarray
    rule: np.ndarray
    distance: np.ndarray


def find_duplicates(phash: np.ndarray, sha_head: np.ndarray, radius: np.ndarray,
                    keeper_order: Callable[[np.ndarray], np.ndarray],
                    same_bytes: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Duplicates:
    """Duplicate groups of n images: `phash` uint64, `sha_head` the first 8 bytes of each sha256 as uint64,
    `radius` int8 the pHash radius of each image's source (-1 off). `keeper_order(nodes)` gives, for image
    indexes, integers that order them as keepers (lower wins, no ties); `same_bytes(a, b)` says which pairs have
    equal full sha256 (the head only proposes them)."""
    a, b = _same_bytes_pairs(sha_head, same_bytes)
    if (radius >= 0).all():  # no source is `off`: no subset to copy (10^8 hashes: 1.6 GB saved)
        ea, eb = _equal_runs(phash)
    else:
        exact = np.flatnonzero(radius >= 0)
        ea, eb = _equal_runs(phash[exact])
        ea, eb = exact[ea], exact[eb]
    near_a, near_b = _near_pairs(phash, radius)
    first = np.concatenate([a, ea, near_a])
    second = np.concatenate([b, eb, near_b])
    return _groups(first, second, phash, keeper_order, same_bytes)


def _equal_runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (first of its run, other) of positions with equal values: a star per run of a sort, which joins
    every run into one group with len(run) - 1 pairs. Which member heads a run does not matter (the group is the
    same), so the sort need not be stable; only the few positions in runs get arrays of their own."""
    order = np.argsort(values)
    ordered = values[order]
    continues = np.flatnonzero(ordered[1:] == ordered[:-1]) + 1  # sorted positions equal to the one before
    del ordered
    starts = continues[np.concatenate([[True], continues[1:] != continues[:-1] + 1])] - 1 if len(continues) else \
        continues
    head = starts[np.searchsorted(starts, continues, side="right") - 1]
    return order[head].astype(np.int64), order[continues].astype(np.int64)


def _same_bytes_pairs(sha_head: np.ndarray, same_bytes) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of images with equal sha256: equal heads proposed, full digests confirmed. A run whose heads agree
    but not every digest does (a 64-bit collision) is compared pair by pair."""
    head, other = _equal_runs(sha_head)
    confirmed = same_bytes(head, other)
    if confirmed.all():
        return head, other
    doubtful = np.unique(np.concatenate([head[~confirmed], other[~confirmed]]))
    mixed = np.isin(head, doubtful) | np.isin(other, doubtful)
    pairs = [(head[~mixed], other[~mixed])]
    for value in np.unique(sha_head[doubtful]):
        run = np.flatnonzero(sha_head == value)
        i, j = np.triu_indices(len(run), 1)
        keep = same_bytes(run[i], run[j])
        pairs.append((run[i][keep], run[j][keep]))
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def _near_pairs(phash: np.ndarray, radius: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs within a radius > 0, one per pair of distinct pHash values: values shared by several images are
    joined by the exact pass already. A pair counts when it is within the radius of both values' sources (the
    larger radius among a value's images: those images are one group anyway)."""
    from mmtok.curate.search import pairs_within

    near = np.flatnonzero(radius > 0)
    if not len(near):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    values, first, inverse = np.unique(phash[near], return_index=True, return_inverse=True)
    reach = np.zeros(len(values), np.int8)
    np.maximum.at(reach, inverse, radius[near])
    i, j, distance = pairs_within(values, int(reach.max()))
    keep = distance <= np.minimum(reach[i], reach[j])
    return near[first[i[keep]]].astype(np.int64), near[first[j[keep]]].astype(np.int64)


def _groups(first: np.ndarray, second: np.ndarray, phash: np.ndarray, keeper_order, same_bytes) -> Duplicates:
    """Connected components of the pairs; in each, the keeper and, for every other image, why it is dropped."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    nodes = np.unique(np.concatenate([first, second]))
    if not len(nodes):
        empty = np.zeros(0, np.int64)
        return Duplicates(empty, empty, empty, np.zeros(0, object), np.zeros(0, np.int8))
    edges = (np.ones(len(first), np.int8), (np.searchsorted(nodes, first), np.searchsorted(nodes, second)))
    _, label = connected_components(coo_matrix(edges, shape=(len(nodes), len(nodes))), directed=False)
    order = keeper_order(nodes)
    by_group = np.lexsort((order, label))  # each group's keeper first
    starts = np.flatnonzero(np.concatenate([[True], label[by_group][1:] != label[by_group][:-1]]))
    keeper_of_group = by_group[starts]
    rank = np.empty(len(starts), np.int64)
    rank[np.argsort(order[keeper_of_group], kind="stable")] = np.arange(len(starts))
    lengths = np.diff(np.concatenate([starts, [len(nodes)]]))
    keeper = np.repeat(keeper_of_group, lengths)
    group = np.repeat(rank, lengths)
    member = np.ones(len(nodes), bool)
    member[starts] = False
    dropped, keeper, group = nodes[by_group[member]], nodes[keeper[member]], group[member]
    distance = np.bitwise_count(phash[dropped] ^ phash[keeper]).astype(np.int8)
    rule = np.where(distance == 0, "phash_exact", "phash_radius").astype(object)
    rule[same_bytes(dropped, keeper)] = "sha256"
    return Duplicates(dropped, keeper, group, rule, distance)


def dedup(hash_dirs: list[Path], policy_path: Path, out: Path, against: list[Path] = (),
          confirm: list[str] = ()) -> DedupMetadata:
    """Find the duplicates among the hash tables under the policy and, with `against` (benchmark hash tables), the
    images that match a benchmark image (`mmtok.curate.decontaminate`; `confirm` names suspect benchmark items
    `BENCH:KEY` or sources whose matches are dropped anyway); write the list (`mmtok.formats.dedup`); returns
    what dedup.json holds. Every check happens before anything is written."""

    from mmtok.curate.captions import Thresholds
    from mmtok.curate.decontaminate import Guards
    from mmtok.formats.dedup import (
        LOCK_FILE,
        CaptionRecord,
        DedupMetadata,
        ListInput,
        PolicyRecord,
        check_output,
        write_dedup,
    )
    from mmtok.fsutil import WriterLock

    check_output(out)
    policy, guards_entry, captions_entry = load_policy(policy_path)
    guards = Guards.from_policy(policy_path, guards_entry, MAX_BENCH_RADIUS, _SHOWN.repr)
    thresholds = Thresholds.from_policy(policy_path, captions_entry, _SHOWN.repr)
    tables = _open_tables(hash_dirs, policy, policy_path)
    benchmarks = _open_benchmarks(against, tables)
    images = _Images(tables)
    decontamination = None
    if benchmarks:  # first: an image dropped as a benchmark match is never the keeper of its duplicates
        radius = np.array([guards.radius if policy[t.source].decontaminate is None else policy[t.source].decontaminate
                           for t in tables], np.int8)
        decontamination = _Decontamination(images, benchmarks, radius, guards, confirm)
    matched = decontamination.dropped_images() if decontamination else np.zeros(0, np.int64)
    flagged = _caption_flags(images, policy, thresholds, matched)  # nor is an image its caption drops
    radius = np.repeat(np.array([policy[t.source].radius for t in tables], np.int8), images.sizes)

    def duplicates(dropped_first: np.ndarray):
        return find_duplicates(images.phash, images.sha_head(), radius,
                               lambda nodes: images.keeper_order(nodes, policy, dropped_first), images.same_bytes)

    first = np.union1d(matched, flagged.rows)
    found = duplicates(first)
    # The template cap counts the samples that stay: after every other rule, the duplicates included. A capped
    # image keeps no group, so when one was a keeper the groups are elected again without it, which may let a
    # copy stay and count: capped again until nothing changes (the capped set only grows).
    capped = _joined()
    while True:
        more = _template_caps(images, policy, thresholds, np.union1d(first, capped.rows),
                              np.union1d(np.union1d(first, capped.rows), found.dropped))
        if not len(more.rows):
            break
        capped = _joined(capped, more)
        if not np.isin(more.rows, found.keeper).any():
            break  # no group changes: the images that stay are the same, less those just capped
        found = duplicates(np.union1d(first, capped.rows))
    flagged = _joined(flagged, capped)
    listed = _with_caption_rows(images.duplicates_table(found), images, flagged)
    held = None
    if decontamination:
        listed, held = decontamination.apply(listed)
    listed, groups = _renumbered(listed)
    meta = DedupMetadata(
        algorithm=tables[0].algorithm,
        policy={name: PolicyRecord(r.rule, max(r.radius, 0), r.priority) for name, r in sorted(policy.items())},
        inputs=[ListInput(t.source, str(t.directory.resolve()), t.metadata.fingerprint, t.metadata.manifest.directory,
                          t.manifest_fingerprint) for t in tables],
        groups=groups,
        captions=CaptionRecord(dataclasses.asdict(thresholds),
                               sorted(name for name, rule in policy.items() if not rule.captions), len(flagged.rows)),
        decontamination=decontamination.record(held) if decontamination else None,
        counts=_counts(tables, images, listed,
                       decontamination.held_index if decontamination else np.zeros(0, np.int64)))
    out.mkdir(parents=True, exist_ok=True)
    with WriterLock(out, f"the duplicate list in {out}", name=LOCK_FILE):
        return write_dedup(out, listed, meta, held)


def _renumbered(listed):
    """The duplicate groups that still drop an image (a group whose only dropped images are benchmark matches
    has none left), numbered 0.. in keeper order; (the rows, the number of groups)."""
    import pyarrow as pa

    group = listed.column("group").to_numpy()
    duplicate = group >= 0
    kept, inverse = np.unique(group[duplicate], return_inverse=True)
    group = group.copy()
    group[duplicate] = inverse
    return listed.set_column(listed.schema.get_field_index("group"), "group", pa.array(group, pa.int64())), len(kept)


def _caption_flags(images: "_Images", policy: dict[str, SourceRule], thresholds, matched: np.ndarray):
    """The images their captions flag (`mmtok.curate.captions.flag`; global indexes), leaving out the benchmark
    matches `matched` (a match is named as such)."""
    from mmtok.curate.captions import Flags, flag

    joined = _by_source(images, policy, lambda s, table, columns: flag(columns, thresholds, table.fragments))
    keep = ~np.isin(joined.rows, matched)
    return Flags(rows=joined.rows[keep], rule=joined.rule[keep], detail=joined.detail[keep])


def _template_caps(images: "_Images", policy: dict[str, SourceRule], thresholds, named: np.ndarray,
                   dropped: np.ndarray):
    """The images of the samples newly over their template's cap (`mmtok.curate.captions.template_cap`), among
    the images that stay (not in `dropped`); the images in `named` (dropped by another rule, or capped already)
    keep their row."""
    from mmtok.curate.captions import template_cap

    staying = np.ones(len(images.phash), bool)
    staying[dropped] = False
    droppable = np.ones(len(images.phash), bool)
    droppable[named] = False

    def cap(s: int, table, columns):
        first, last = int(images.starts[s]), int(images.starts[s] + images.sizes[s])
        return template_cap(columns, images.documents[first:last], images.keys[first:last], thresholds,
                            staying[first:last], droppable[first:last])

    return _by_source(images, policy, cap)


def _by_source(images: "_Images", policy: dict[str, SourceRule], check):
    """`check(source number, table, its caption columns)` over every source whose captions are checked, its
    Flags (rows of that source) made global and joined."""
    from mmtok.curate.captions import Flags

    found = []
    for s, table in enumerate(images.tables):
        if policy[table.source].captions:
            first, last = int(images.starts[s]), int(images.starts[s] + images.sizes[s])
            got = check(s, table, {name: column[first:last] for name, column in images.captions.items()})
            found.append(Flags(rows=got.rows + first, rule=got.rule, detail=got.detail))
    return _joined(*found)


def _joined(*flags):
    """Several Flags as one, sorted by row (their rows are disjoint)."""
    from mmtok.curate.captions import Flags

    if not flags:
        return Flags(np.zeros(0, np.int64), np.zeros(0, object), np.zeros(0, object))
    rows = np.concatenate([f.rows for f in flags])
    order = np.argsort(rows, kind="stable")
    return Flags(rows=rows[order], rule=np.concatenate([f.rule for f in flags])[order],
                 detail=np.concatenate([f.detail for f in flags])[order])


def _with_caption_rows(listed, images: "_Images", flagged):
    """The dropped rows with every caption-flagged image's row in place of its duplicate row (if it had one)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(flagged.rows)
    index = pa.array(flagged.rows, pa.int64())
    rows = pa.table({"index": flagged.rows, "source": images.names[images.source_of[flagged.rows]],
                     "manifest_row": images.rows[flagged.rows], "key": images.keys.take(index),
                     "group": np.full(n, -1, np.int64), "keeper_source": pa.nulls(n, pa.string()),
                     "keeper_row": np.full(n, -1, np.int64), "keeper_key": pa.nulls(n, pa.string()),
                     "rule": flagged.rule, "distance": np.full(n, -1, np.int8), "detail": flagged.detail},
                    schema=listed.schema)
    duplicates = listed.filter(pc.invert(pc.is_in(listed.column("index"), index)))
    return pa.concat_tables([duplicates, rows]).sort_by("index")


class _Images:
    """The images of every training table, concatenated in (source name, manifest row) order."""

    def __init__(self, tables: list):
        import pyarrow as pa

        self.tables = tables
        columns = [table.read() for table in tables]
        self.sizes = np.array([len(c) for c in columns], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.captions = {name: np.concatenate([c.captions[name] for c in columns]) for name in
                         (columns[0].captions if columns else ())}
        self.source_of = np.repeat(np.arange(len(tables)), self.sizes)
        self.sha = np.concatenate([c.sha256 for c in columns]) if columns else np.zeros((0, 32), np.uint8)
        self.rows = np.concatenate([c.manifest_row for c in columns])
        self.keys = pa.chunked_array([c.key for c in columns], pa.string())
        self.documents = np.concatenate([c.document for c in columns]) if columns else np.zeros(0, np.int64)
        self.pixels = np.concatenate([c.pixels for c in columns])
        self.phash = np.concatenate([c.phash for c in columns])
        self.names = np.array([t.source for t in tables], dtype=object)

    def sha_head(self) -> np.ndarray:
        from mmtok.curate.decontaminate import sha_heads

        return sha_heads(self.sha)

    def same_bytes(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.all(self.sha[a] == self.sha[b], axis=1)

    def keeper_order(self, nodes: np.ndarray, policy: dict[str, SourceRule], matched: np.ndarray) -> np.ndarray:
        """KEEPER_ORDER over the images `nodes` (`matched`: the sorted images dropped as benchmark matches), sorted
        by Arrow (keys stay Arrow strings, compared as bytes)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        priority = np.array([policy[t.source].priority for t in self.tables], np.int64)
        candidates = pa.table({"matched": np.isin(nodes, matched), "priority": priority[self.source_of[nodes]],
                               "pixels": self.pixels[nodes],
                               "source": self.source_of[nodes], "key": self.keys.take(pa.array(nodes)),
                               "row": self.rows[nodes]})
        ranked = pc.sort_indices(candidates, sort_keys=KEEPER_ORDER).to_numpy()
        order = np.empty(len(nodes), np.int64)
        order[ranked] = np.arange(len(nodes))
        return order

    def duplicates_table(self, found: Duplicates):
        """dropped.parquet's rows of the duplicates, in global index (= source name, manifest row) order."""
        import pyarrow as pa

        order = np.argsort(found.dropped)
        dropped, keeper = found.dropped[order], found.keeper[order]
        return pa.table({"index": dropped, "source": self.names[self.source_of[dropped]],
                         "manifest_row": self.rows[dropped], "key": self.keys.take(pa.array(dropped, pa.int64())),
                         "group": found.group[order], "keeper_source": self.names[self.source_of[keeper]],
                         "keeper_row": self.rows[keeper], "keeper_key": self.keys.take(pa.array(keeper, pa.int64())),
                         "rule": found.rule[order], "distance": found.distance[order],
                         "detail": np.full(len(order), "", object)}, schema=_listed_schema())


def _counts(tables, images: "_Images", listed, held: np.ndarray) -> dict[str, SourceCounts]:
    """Per source: images hashed = kept + dropped, the dropped by rule, and the matches held back (kept), counted
    by integer codes (a list of 10^7 rows over many sources stays a few bincounts)."""
    import pyarrow.compute as pc

    from mmtok.formats.dedup import RULES, SourceCounts

    source = images.source_of[listed.column("index").to_numpy()]
    rules = pc.dictionary_encode(listed.column("rule")).combine_chunks()
    code = rules.indices.to_numpy(zero_copy_only=False)
    names = rules.dictionary.to_pylist()
    by_rule = {name: np.bincount(source[code == names.index(name)], minlength=len(tables)) if name in names
               else np.zeros(len(tables), np.int64) for name in RULES}
    dropped = np.bincount(source, minlength=len(tables))
    kept_back = np.bincount(images.source_of[held], minlength=len(tables))
    return {table.source: SourceCounts(hashed=int(images.sizes[s]), kept=int(images.sizes[s] - dropped[s]),
                                       dropped=int(dropped[s]), by_rule={name: int(by_rule[name][s]) for name in RULES},
                                       held=int(kept_back[s])) for s, table in enumerate(tables)}


def _open_benchmarks(against: list[Path], tables: list) -> list:
    """The benchmark hash tables (`mmtok hash --source BENCHMARK` of its images), sorted by name, after the checks
    that make them comparable with the training tables and name every match unambiguously."""
    from mmtok.formats.hashes import HashTable

    benchmarks = sorted((HashTable.open(d) for d in against), key=lambda t: t.source)
    names = {t.source: t.directory for t in tables}
    for bench in benchmarks:
        if bench.algorithm != tables[0].algorithm:
            raise MmtokError(f"the benchmark hash table {bench.directory} was made by {bench.algorithm}, the training "
                             f"tables by {tables[0].algorithm}: their hashes cannot be compared; hash the benchmark "
                             "images with this `mmtok hash`")
        if ":" in bench.source:  # --confirm names a benchmark image as BENCHMARK:KEY: the name must end at its ':'
            raise MmtokError(f"{bench.directory}: benchmark name {bench.source!r} holds ':'; hash it again with "
                             "`mmtok hash --source NAME` (a name without ':')")
        if bench.source in names:
            raise MmtokError(f"{bench.directory} and {names[bench.source]} have the same source name "
                             f"{bench.source!r}; a benchmark is named apart from every source (`mmtok hash --source "
                             "NAME`)")
        names[bench.source] = bench.directory
    return benchmarks


class _Decontamination:
    """The benchmark matches of the training images (`mmtok.curate.decontaminate`), found before the duplicate
    groups so that a match never keeps a group, applied to the dropped rows after."""

    def __init__(self, images: _Images, benchmarks: list, radius: np.ndarray, guards, confirm: list[str]):
        from mmtok.curate.decontaminate import choose, match_pairs

        self.images, self.benchmarks, self.radius, self.guards = images, benchmarks, radius, guards
        self.confirm = sorted(set(confirm))
        self.bench = _Images(benchmarks)
        pairs = match_pairs(images.phash, images.sha, radius[images.source_of], self.bench.phash, self.bench.sha)
        items, sources = _confirmed(self.confirm, images, self.bench)
        self.found = choose(*pairs, images.source_of, images.sizes, guards, items, sources)

    def dropped_images(self) -> np.ndarray:
        return self.found.train[self.found.dropped]  # sorted: one entry per image, in index order

    def _rows(self, chosen: np.ndarray) -> dict:
        import pyarrow as pa

        found, images, bench = self.found, self.images, self.bench
        index, other = found.train[chosen], found.bench[chosen]
        return {"index": index, "source": images.names[images.source_of[index]], "manifest_row": images.rows[index],
                "key": images.keys.take(pa.array(index, pa.int64())),
                "bench_source": bench.names[bench.source_of[other]], "bench_row": bench.rows[other],
                "bench_key": bench.keys.take(pa.array(other, pa.int64())), "distance": found.distance[chosen]}

    def apply(self, listed):
        """(the dropped rows with every benchmark match in place of its duplicate row, the matches held back)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from mmtok.formats.dedup import BENCHMARK_RULE

        hit = self._rows(self.found.dropped)
        n = len(hit["index"])
        matches = pa.table({"index": hit["index"], "source": hit["source"], "manifest_row": hit["manifest_row"],
                            "key": hit["key"], "group": np.full(n, -1, np.int64), "keeper_source": hit["bench_source"],
                            "keeper_row": hit["bench_row"], "keeper_key": hit["bench_key"],
                            "rule": np.full(n, BENCHMARK_RULE, object), "distance": hit["distance"],
                            "detail": np.full(n, "", object)}, schema=listed.schema)
        duplicates = listed.filter(pc.invert(pc.is_in(listed.column("index"), pa.array(hit["index"], pa.int64()))))
        listed = pa.concat_tables([duplicates, matches]).sort_by("index")
        kept = ~self.found.dropped & ~np.isin(self.found.train, listed.column("index").to_numpy())  # not dropped
        self.held_index = self.found.train[kept]
        held = pa.table({**{k: v for k, v in self._rows(kept).items() if k != "index"}, "why": self.found.why[kept]})
        return listed, held

    def record(self, held) -> DecontaminationRecord:
        """What dedup.json records of the decontamination."""
        from mmtok.formats.dedup import Benchmark, DecontaminationRecord, GuardRecord, SuspectImage, SuspectSource

        found, images, bench, guards = self.found, self.images, self.bench, self.guards
        return DecontaminationRecord(
            against=[Benchmark(t.source, str(t.directory.resolve()), t.metadata.fingerprint, int(size))
                     for t, size in zip(self.benchmarks, bench.sizes, strict=True)],
            guards=GuardRecord(guards.max_matches, guards.max_share, guards.min_flagged),
            radius={t.source: int(r) if r >= 0 else "off" for t, r in zip(images.tables, self.radius, strict=True)},
            suspect_images=[SuspectImage(f"{bench.names[bench.source_of[b]]}:{bench.keys[b].as_py()}",
                                         int(bench.rows[b]), n) for b, n in sorted(found.suspect_items.items())],
            suspect_sources=[SuspectSource(images.names[s], flagged, hashed)
                             for s, (flagged, hashed) in sorted(found.suspect_sources.items())],
            confirmed=list(self.confirm), contaminated=int(found.dropped.sum()), held=held.num_rows)


def _confirmed(confirm: list[str], images: _Images, bench: _Images) -> tuple[set[int], set[int]]:
    """The benchmark images (`BENCH:KEY`: every image of that sample) and training sources `--confirm` names;
    MmtokError for a name that is neither (a typo must not pass for a confirmation)."""
    sources = {name: s for s, name in enumerate(images.names)}
    labels: dict[str, list[int]] = {}
    if any(name not in sources for name in confirm):
        for b, (s, key) in enumerate(zip(bench.source_of.tolist(), bench.keys.to_pylist(), strict=True)):
            labels.setdefault(f"{bench.names[s]}:{key}", []).append(b)
    items, chosen = set(), set()
    for name in confirm:
        if name in sources:
            chosen.add(sources[name])
        elif name in labels:
            items.update(labels[name])
        else:
            raise MmtokError(f"--confirm {name[:200]!r} names neither a training source ({', '.join(sources)}) nor a "
                             "benchmark image as BENCHMARK:KEY; the suspects are named in the summary of a run without "
                             "it")
    return items, chosen


def _open_tables(hash_dirs: list[Path], policy: dict[str, SourceRule], policy_path: Path) -> list:
    """The hash tables, sorted by source name, after the checks that make them comparable under the policy."""
    from mmtok.formats.hashes import HashTable

    tables = sorted((HashTable.open(d) for d in hash_dirs), key=lambda t: t.source)
    algorithms = {t.algorithm for t in tables}
    if len(algorithms) > 1:
        listed = ", ".join(f"{t.directory} ({t.algorithm})" for t in tables)
        raise MmtokError(f"the hash tables were made by different algorithms, whose hashes cannot be compared: "
                         f"{listed}; hash every source with the same `mmtok hash`")
    for attribute, what in (("source", "source name"), ("manifest_fingerprint", "manifest")):
        seen: dict[str, Path] = {}
        for table in tables:
            value = getattr(table, attribute)
            if value in seen:
                raise MmtokError(f"{seen[value]} and {table.directory} have the same {what} ({value[:40]}); each "
                                 "source is given once (name sources with `mmtok hash --source NAME`)")
            seen[value] = table.directory
    given = {t.source for t in tables}
    if set(policy) != given:
        unknown, missing = sorted(set(policy) - given), sorted(given - set(policy))
        raise MmtokError(f"{policy_path} does not match the hash tables: "
                         + "; ".join(part for part in (
                             f"it names source(s) {unknown} that no hash table is" if unknown else "",
                             f"it has no rule for source(s) {missing}" if missing else "") if part)
                         + f" (the tables' sources: {sorted(given)})")
    return tables
