"""Caption checks: what `mmtok hash` measures of each sample's caption, and what `mmtok dedup` flags of it.

Captions written by a model fail in a few recognisable ways: a phrase looping ("a cat a cat a cat ..."), a
runaway list of numbers, the last sentence said again and again, a fragment of the prompt copied into the answer,
and one response template ("The image shows ...") making up most of a source. `mmtok hash` reads each sample's
caption once, in the pass that hashes its image, and records numbers (`Measures`), never a verdict: the
thresholds are the policy's (`Thresholds`, `captions:` in the policy file), so changing one needs `mmtok dedup`
again, not a new hash pass. Only the prompt fragments are matched at hash time (the text is not kept), so they are
given to `mmtok hash --prompt-fragments FILE` and recorded in its hashes.json.

Words are Unicode word runs (`\\w+`) of the case-folded text, except that each Han, kana or Hangul character is a
word of its own (those scripts write no spaces: a looping Chinese caption is then a loop of characters):
punctuation, case and spacing never hide a repeat.
Every caption costs bounded time and memory: only its first MAX_CAPTION_BYTES are read, and each measure is a
fixed number of linear passes over its words.

Written here rather than taken from a library: the measures are a few lines each, and what they count has to be
stated exactly (docs/curation.md), for a threshold in a policy to mean something.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.dedup import CAPTION_RULES

CHECKS_VERSION = 1  # what the measures mean: recorded in hashes.json; a change needs `mmtok hash` again
MAX_CAPTION_BYTES = 1 << 16  # a caption's first 64 KiB are checked; a hostile 1 GB sidecar costs no more
LOOP_WORDS = 8  # loops of phrases of 1..8 words are counted
TEMPLATE_WORDS = 4  # a caption's template: its first 4 words (numbers as 0); shorter captions have none
MAX_FRAGMENTS = 10_000
MAX_FRAGMENT_WORDS = 32
MAX_FRAGMENTS_BYTES = 1 << 20
# `words` of a row without a checked caption (its other measures are 0, its fragment -1, its template 0)
NO_CAPTION, NOT_UTF8, UNREADABLE = -1, -2, -3
UNCHECKED = {NO_CAPTION: "no_caption", NOT_UTF8: "caption_not_utf8", UNREADABLE: "caption_unreadable"}

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD = re.compile(f"(?=\\w)[{_CJK}]|(?:(?![{_CJK}])\\w)+")  # a CJK character that is a word character
_PLAIN_WORD = re.compile(r"\w+")  # the same words in a text without CJK characters, 5x faster
_ANY_CJK = re.compile(f"[{_CJK}]")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f\u2026]+")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Measures:
    """What `mmtok hash` records of one caption (the hash table's `caption_*` columns)."""

    words: int  # its words; NO_CAPTION, NOT_UTF8 or UNREADABLE when it was not checked
    loop: int = 0  # the most times one phrase of 1..LOOP_WORDS words is repeated in a row (1: none repeats)
    number_run: int = 0  # the most numbers in a row
    ending: int = 0  # how many times its last sentence is said in a row at its end (1: once)
    fragment: int = -1  # the first prompt fragment in it (its line's position among the fragments), -1 none
    template: int = 0  # uint64 of its first TEMPLATE_WORDS words; 0 when it has fewer


class Fragments:
    """Prompt fragments: strings that should never appear in a caption (a prompt echoed into the answer), one
    per line of a UTF-8 file; matched word for word (case, punctuation and spacing aside)."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        self._by_length: dict[int, dict[tuple[str, ...], int]] = {}
        for index, words in enumerate(map(_words, lines)):
            if words:  # a line without words would match everywhere (`read` refuses it)
                self._by_length.setdefault(len(words), {}).setdefault(tuple(words), index)
        self._firsts = {words[0] for by_words in self._by_length.values() for words in by_words}
        self._lengths = sorted(self._by_length)

    @classmethod
    def read(cls, path: Path) -> Fragments:
        """The fragments of the file at `path`; MmtokError in one line naming the fix for anything else."""
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_FRAGMENTS_BYTES + 1)
        except OSError as err:
            raise MmtokError(f"cannot read the prompt fragments {path}: {err.strerror or err}") from None
        if len(data) > MAX_FRAGMENTS_BYTES:
            raise MmtokError(f"{path}: prompt fragments are at most {MAX_FRAGMENTS_BYTES:,} bytes")
        try:
            text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is not part of line 1
        except UnicodeDecodeError as err:
            line = data[:err.start].count(b"\n") + 1
            raise MmtokError(f"{path} is not UTF-8 (line {line}, byte {err.start}); save it as UTF-8") from None
        lines = [line.strip() for line in text.split("\n")]  # lines as an editor numbers them
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line]
        for n, line in numbered:
            count = len(_words(line))
            if not 1 <= count <= MAX_FRAGMENT_WORDS:
                raise MmtokError(f"{path}: line {n} has {count} words; a fragment has 1..{MAX_FRAGMENT_WORDS} (a word "
                                 "is a run of letters or digits)")
        if len(numbered) > MAX_FRAGMENTS:
            raise MmtokError(f"{path}: {len(numbered):,} fragments; at most {MAX_FRAGMENTS:,}")
        if not numbered:
            raise MmtokError(f"{path} holds no fragment (one per line); leave out --prompt-fragments to look for none")
        return cls([line for _, line in numbered])

    def first_in(self, words: list[str]) -> int:
        """The fragment that starts first in `words` (the lowest line of those starting there), or -1. A lookup
        per word and fragment length: bounded by MAX_FRAGMENT_WORDS lookups per word whatever the file holds."""
        for start in range(len(words)):
            if words[start] not in self._firsts:
                continue
            found = [self._by_length[n].get(tuple(words[start:start + n]), -1) for n in self._lengths
                     if start + n <= len(words)]
            hits = [index for index in found if index >= 0]
            if hits:
                return min(hits)
        return -1


def _words(text: str) -> list[str]:
    text = text.casefold()
    return (_WORD if _ANY_CJK.search(text) else _PLAIN_WORD).findall(text)


def measure(data: bytes, truncated: bool, fragments: Fragments | None) -> Measures:
    """The measures of one caption's bytes (its first MAX_CAPTION_BYTES: `truncated` when there were more, so a
    character cut in two at its very end is not taken for bad UTF-8; any other bad byte is)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        if not (truncated and err.reason == "unexpected end of data" and err.end == len(data)):
            return Measures(words=NOT_UTF8)
        text = data[:err.start].decode("utf-8")
    words = _words(text)
    if not words:
        return Measures(words=0)
    return Measures(words=len(words), loop=_longest_loop(words), number_run=_longest(
        np.fromiter((w.isdecimal() for w in words), bool, len(words))), ending=_ending_repeats(text),
        fragment=fragments.first_in(words) if fragments else -1, template=_template(words))


def _longest(flags: np.ndarray) -> int:
    """The longest run of True."""
    if not flags.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]).astype(np.int8)))
    return int((edges[1::2] - edges[0::2]).max())


def _longest_loop(words: list[str]) -> int:
    """The most times a phrase of g <= LOOP_WORDS words occurs in a row: k repeats make a run of (k - 1) * g
    positions i whose word equals word i + g."""
    codes: dict[str, int] = {}
    ids = np.fromiter((codes.setdefault(w, len(codes)) for w in words), np.int64, len(words))
    best = 1
    for g in range(1, min(LOOP_WORDS, len(ids) // 2) + 1):
        best = max(best, _longest(ids[:-g] == ids[g:]) // g + 1)
    return best


def _ending_repeats(text: str) -> int:
    """How many times the last sentence is said in a row at the end. A last sentence that only begins the one
    before it (a loop cut off by a length limit) is left out."""
    sentences = [tuple(_words(s)) for s in _SENTENCE_END.split(text.casefold())]
    sentences = [s for s in sentences if s]
    if len(sentences) >= 2 and _cut_off(sentences[-1], sentences[-2]):
        sentences.pop()
    if not sentences:
        return 0
    count = 1
    while count < len(sentences) and sentences[-1 - count] == sentences[-1]:
        count += 1
    return count


def _cut_off(last: tuple[str, ...], before: tuple[str, ...]) -> bool:
    """Whether `last` is the start of `before` cut off, perhaps inside a word."""
    n = len(last)
    return last != before and n <= len(before) and last[:-1] == before[:n - 1] and before[n - 1].startswith(last[-1])


def _template(words: list[str]) -> int:
    """A 64-bit id of the first TEMPLATE_WORDS words, numbers written as 0 (never 0 itself)."""
    if len(words) < TEMPLATE_WORDS:
        return 0
    opening = " ".join(_DIGITS.sub("0", w) for w in words[:TEMPLATE_WORDS])
    value = int.from_bytes(hashlib.blake2b(opening.encode("utf-8"), digest_size=8).digest(), "little")
    return value or 1


def opening(text: str) -> str:
    """The template words of a caption as `_template` reads them (for the report)."""
    return " ".join(_DIGITS.sub("0", w) for w in _words(text)[:TEMPLATE_WORDS])


# ---- the policy side: `mmtok dedup` ----

# The rule of a caption-flagged image in the drop list, one per check, in the order a row is named by (the first
# that holds): the fragment is the plainest evidence, the template cap the weakest.
FRAGMENT, LOOP, ENDING, NUMBERS, TEMPLATE = CAPTION_RULES


@dataclass(frozen=True)
class Thresholds:
    """The `captions:` mapping of a policy (every key optional; a number check may be `off`)."""

    loop: int | None = 4  # flagged: a phrase of 1..8 words repeated more than 4 times in a row
    number_run: int | None = 16  # flagged: more than 16 numbers in a row
    ending: int | None = 2  # flagged: the last sentence said more than twice in a row
    fragments: bool = True  # flagged: a prompt fragment in the caption (`mmtok hash --prompt-fragments`)
    template_share: float | None = 0.5  # a template above this share of a source's captions is capped to it...
    template_min: int = 1000  # ...in a source with at least this many checked captions

    @classmethod
    def from_policy(cls, path: Path, entry, shown) -> Thresholds:
        """The thresholds of the policy's `captions:` mapping; MmtokError naming the key for anything else."""
        if not isinstance(entry, dict):
            raise MmtokError(f"{path}: `captions:` is a mapping of {', '.join(f.name for f in fields(cls))} "
                             f"(docs/curation.md), got {shown(entry)}")
        known = {f.name for f in fields(cls)}
        unknown = [key for key in entry if key not in known]
        if unknown:
            raise MmtokError(f"{path}: `captions:` has no key {shown(unknown[0])} (known: {', '.join(sorted(known))})")
        values = {}
        for key, written in entry.items():
            value = "off" if written is False else "on" if written is True else written
            values[key] = _threshold(path, key, value, shown(written))
        return cls(**values)


def _threshold(path: Path, key: str, value, written: str):
    integer = isinstance(value, int) and not isinstance(value, bool)
    if key == "fragments" and value in ("on", "off"):
        return value == "on"
    if key in ("loop", "number_run", "ending") and (value == "off" or integer and value >= 1):
        return None if value == "off" else value
    if key == "template_share" and (value == "off" or isinstance(value, (int, float)) and not isinstance(value, bool)
                                    and 0 < value < 1):
        return None if value == "off" else float(value)
    if key == "template_min" and integer and value >= 1:
        return value
    want = {"fragments": "on or off", "template_share": "a share in (0, 1) or off",
            "template_min": "an integer >= 1"}.get(key, "an integer >= 1 or off")
    raise MmtokError(f"{path}: `captions: {key}` is {want}, got {written}")


@dataclass(frozen=True)
class Flags:
    """The caption-flagged images of one source: their positions among its rows, rule and detail."""

    rows: np.ndarray  # int64, sorted
    rule: np.ndarray  # object
    detail: np.ndarray  # object


def flag(columns: dict[str, np.ndarray], thresholds: Thresholds, fragments: list[str]) -> Flags:
    """The rows of one source's hash table that a caption rule flags (all of RULES but the template cap), each
    with the first rule that holds. `columns`: the table's caption columns (`caption_words`, ... as arrays)."""
    n = len(columns["caption_words"])
    rule = np.full(n, None, object)
    detail = np.full(n, None, object)
    t = thresholds
    checks = [(FRAGMENT, t.fragments and fragments, columns["caption_fragment"] >= 0,
               lambda i: f"prompt fragment {_quoted(fragments[columns['caption_fragment'][i]])}"),
              (LOOP, t.loop, columns["caption_loop"] > (t.loop or 0),
               lambda i: f"a phrase repeated {columns['caption_loop'][i]} times in a row (loop: {t.loop})"),
              (ENDING, t.ending, columns["caption_ending"] > (t.ending or 0),
               lambda i: f"its last sentence said {columns['caption_ending'][i]} times (ending: {t.ending})"),
              (NUMBERS, t.number_run, columns["caption_number_run"] > (t.number_run or 0),
               lambda i: f"{columns['caption_number_run'][i]} numbers in a row (number_run: {t.number_run})")]
    for name, enabled, hit, say in checks:
        if not enabled:
            continue
        for i in np.flatnonzero(hit & (rule == None)).tolist():  # noqa: E711 (an object array's empty cells)
            rule[i], detail[i] = name, say(i)
    rows = np.flatnonzero(rule != None)  # noqa: E711
    return Flags(rows=rows.astype(np.int64), rule=rule[rows], detail=detail[rows])


def _quoted(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


def template_cap(columns: dict[str, np.ndarray], documents: np.ndarray, keys, thresholds: Thresholds,
                 staying: np.ndarray, droppable: np.ndarray) -> Flags:
    """The images of the samples over their template's cap. A sample is a document of the manifest (its images
    share its caption). A template may begin at most `template_share` of the source's checked captions (at least
    one) among the samples that stay (`staying`: per row, whether no rule drops it); the staying samples of a
    template over its cap are ranked by a hash of their key (then their document id) and those past the cap
    lose every image that is `droppable` (per row: not dropped by a rule that names it otherwise): neither the
    row order nor the world size decides, a document is never split, and never the whole source."""
    t = thresholds
    empty = Flags(np.zeros(0, np.int64), np.zeros(0, object), np.zeros(0, object))
    if t.template_share is None:
        return empty
    checked = len(np.unique(documents[columns["caption_words"] >= 0]))
    if checked < t.template_min:
        return empty
    cap = max(1, int(t.template_share * checked))
    template = np.where(staying, columns["caption_template"], 0)
    values, counts = np.unique(template[template != 0], return_counts=True)
    flagged: list[np.ndarray] = []
    details: list[str] = []
    for value in values[counts > cap].tolist():  # rows >= samples: a template under the cap in rows is under it
        rows = np.flatnonzero(template == value)
        samples, first = np.unique(documents[rows], return_index=True)
        if len(samples) <= cap:
            continue
        ranks = [(_key_rank(key), int(doc)) for key, doc in
                 zip(keys.take(rows[first]).to_pylist(), samples.tolist(), strict=True)]
        over = np.array([doc for _, doc in sorted(ranks)[cap:]], np.int64)
        hit = np.flatnonzero(np.isin(documents, over) & droppable)
        flagged.append(hit)
        details += [f"its template begins {len(samples):,} of the source's {checked:,} captions "
                    f"({len(samples) / checked:.0%}); {cap:,} kept (template_share: {t.template_share:g})"] * len(hit)
    if not flagged:
        return empty
    rows = np.concatenate(flagged)
    order = np.argsort(rows)
    return Flags(rows=rows[order].astype(np.int64), rule=np.full(len(rows), TEMPLATE, object),
                 detail=np.array(details, object)[order])


def _key_rank(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
