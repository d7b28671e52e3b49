"""`mmtok audio convert`: audio sources -> Lhotse Shar shards (24 kHz mono FLAC + text token ids).

Output directory OUT (the Shar layout and the report are `mmtok.formats.shar`'s):
  OUT/shar/cuts.NNNNNN.jsonl.gz, OUT/shar/recording.NNNNNN.tar   lhotse's own SharWriter output,
      read back with `CutSet.from_shar(in_dir=OUT/shar)`
  OUT/conversion.json   parameters, inputs, shards (cuts, duration, fingerprint), counts by reason,
      the resume cursor and `complete`; rewritten atomically after every shard
  OUT/dropped/dropped.{inputs,NNNNNN,tail}.jsonl   a skip record (`mmtok.formats.skips`) for every clip,
      record or file that did not become a clip, with its reason
  OUT/.lock             the writer lock: one conversion writes OUT at a time, a second is refused

Counts add up: `in` (every clip, record and file the inputs hold) = `written` + every `skipped:<reason>`
+ every `ignored:<extension>` (non-audio files of a directory input).

Guarantees: the output depends only on the inputs and the parameters (not on --workers or on
restarts); clips appear in input order (units in input order, clips in unit order); a shard is
written under OUT/.work and moved into OUT/shar only when complete, and conversion.json records it
afterwards, so a killed run resumes after its last recorded shard and never redoes one.

Audio is stored as 24-bit FLAC. 16-bit (lhotse's default) would leave a quiet clip (say -50 dBFS
peak) with ~46 dB SNR, and the later -3 dBFS peak normalization amplifies that quantization noise
along with the speech; 24 bits keep ~140 dB. Values at or over full scale (float sources, resampler
overshoot) cannot be stored in integer FLAC, so such a clip is scaled just below full scale and the
gain is recorded in `cut.custom["gain"]`; the encode stage peak-normalizes, which undoes any gain.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mmtok import __version__
from mmtok.audio.sources import Collected, collect_units
from mmtok.audio.sources.parquet import close_tables
from mmtok.audio.sources.units import ClipSpec, Unit, pick_channel, skip_record
from mmtok.errors import MmtokError
from mmtok.formats import shar as shar_format
from mmtok.formats import skips
from mmtok.formats.conversations import check_media_roots
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import WriterLock, atomic_write_bytes, shown_path, with_filename
from mmtok.media.audio import RESAMPLER, SILENCE_PEAK, TARGET_SAMPLE_RATE, AudioReason, check_finite, resample

STORAGE = {"format": "flac", "subtype": "PCM_24", "sample_rate": TARGET_SAMPLE_RATE, "channels": 1}
MAX_STORED_PEAK = 1.0 - 2.0**-22  # largest |x| that survives float -> 24-bit PCM without clipping


@dataclass(frozen=True)
class ConvertOptions:
    """Validation thresholds and output layout; all recorded in the report and checked on resume."""

    min_duration: float = 0.3
    max_duration: float = 60.0
    min_rms_dbfs: float = -60.0
    shard_size: int = 5000
    text_tokenizer: str = "tekken"


@dataclass
class Clip:
    """A valid clip, ready for the Shar writer."""

    spec: ClipSpec
    flac: bytes
    num_samples: int
    original_rate: int
    gain: float
    text_tokens: list[int] | None
    source_sha256: str | None = None  # of the bytes the clip was decoded from (None: lhotse read them)


# --- one clip ---------------------------------------------------------------------------------

def cut_segment(samples: np.ndarray, rate: int, spec: ClipSpec) -> np.ndarray:
    """The clip's samples of a mono payload (segment bounds in seconds, the end clamped to the payload)."""
    if spec.start is None and spec.end is None:
        return samples
    first = int(round((spec.start or 0.0) * rate))
    last = samples.size if spec.end is None else min(samples.size, int(round(spec.end * rate)))
    if first >= samples.size or last <= first:
        raise AudioReason("segment_out_of_range",
                          f"[{spec.start}, {spec.end}] s of a {samples.size / rate:.3f} s payload")
    return samples[first:last]


def rms_dbfs(samples: np.ndarray) -> float:
    rms = math.sqrt(float(np.mean(np.square(samples, dtype=np.float64))))
    return 20.0 * math.log10(rms) if rms > 0 else -math.inf


def prepare_clip(samples: np.ndarray, rate: int, spec: ClipSpec, options: ConvertOptions, tokenizer,
                 source_sha256: str | None = None) -> Clip:
    """Validate, resample to 24 kHz mono and encode one clip (bound to the digest of the bytes it was
    decoded from); raises AudioReason with the drop reason."""
    clip = cut_segment(pick_channel(samples, spec.channel), rate, spec)
    check_finite(clip)  # zero_length / non_finite
    duration = clip.size / rate
    if duration < options.min_duration:
        raise AudioReason("too_short", f"{duration:.3f} s < {options.min_duration} s")
    if duration > options.max_duration:
        raise AudioReason("too_long", f"{duration:.3f} s > {options.max_duration} s")
    if float(np.max(np.abs(clip))) < SILENCE_PEAK:
        raise AudioReason("silent", "digital silence")
    level = rms_dbfs(clip)
    if level < options.min_rms_dbfs:
        raise AudioReason("too_quiet", f"RMS {level:.1f} dBFS < {options.min_rms_dbfs} dBFS")
    wave = resample(clip, rate, TARGET_SAMPLE_RATE)
    peak = float(np.max(np.abs(wave)))
    gain = 1.0 if peak <= MAX_STORED_PEAK else MAX_STORED_PEAK / peak
    if gain != 1.0:
        wave = wave * np.float32(gain)
    tokens = tokenizer.encode(spec.text) if spec.text is not None else None
    return Clip(spec, encode_flac(wave), int(wave.size), rate, gain, tokens, source_sha256)


def encode_flac(wave: np.ndarray) -> bytes:
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, TARGET_SAMPLE_RATE, format="FLAC", subtype=STORAGE["subtype"])
    return buffer.getvalue()


# --- worker side ----------------------------------------------------------------------------------

_WORKER: dict = {}


def init_worker(options: ConvertOptions, tokenizer=None, parent: int | None = None) -> None:
    """Process-pool initializer: tie the worker's life to `parent`, then load the text tokenizer once
    per worker (or take the caller's)."""
    from mmtok.text import load_text_tokenizer

    if parent is not None:
        die_with_parent(parent)
    _WORKER["options"] = options
    _WORKER["tokenizer"] = tokenizer or load_text_tokenizer(options.text_tokenizer)


def die_with_parent(parent: int) -> None:
    """Guarantee this process ends when process `parent` (its parent) does, SIGKILL included.

    Linux delivers SIGKILL to us when the parent exits (PR_SET_PDEATHSIG); a parent that died before
    that call is caught by the pid check after it. Elsewhere only the check is made.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # re-parented: the parent is gone already
        os._exit(1)  # what the death signal would have done; raising would only mark a dead pool broken


def process_unit(unit: Unit) -> list[Clip | SkipRecord]:
    """Every clip of one work unit, in order, as a Clip or a skip record (never raises for bad audio)."""
    options, tokenizer = _WORKER["options"], _WORKER["tokenizer"]
    results: list[Clip | SkipRecord] = []
    for item in unit.payloads():
        if isinstance(item, SkipRecord):
            results.append(item)
            continue
        loader, clips = item
        try:
            samples, rate, digest = loader()
        except AudioReason as err:
            results.extend(skip_record(c.id, c.origin, err.reason, str(err)) for c in clips)
            continue
        for spec in clips:
            try:
                results.append(prepare_clip(samples, rate, spec, options, tokenizer, digest))
            except AudioReason as err:
                results.append(skip_record(spec.id, spec.origin, err.reason, str(err)))
    return results


def ordered_results(units: list[Unit], options: ConvertOptions, workers: int,
                    tokenizer) -> Iterator[list[Clip | SkipRecord]]:
    """process_unit over `units`, results in input order, at most 2 * workers units in flight."""
    if workers <= 0:
        init_worker(options, tokenizer)
        try:
            yield from map(process_unit, units)
        finally:
            close_tables()
        return
    import multiprocessing

    # spawn, not fork: the parent holds torch/lhotse threads, which fork would copy in a locked state.
    # Not forkserver either: its workers are the server's children, and die_with_parent needs ours.
    # Workers are started by submit(), from this (the iterating) thread, which outlives them.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker,
                             initargs=(options, None, os.getpid())) as pool:
        pending: list[Future] = []
        iterator = iter(units)
        for unit in iterator:
            pending.append(pool.submit(process_unit, unit))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.pop(0).result()
            unit = next(iterator, None)
            if unit is not None:
                pending.append(pool.submit(process_unit, unit))
            yield result


# --- writer side ----------------------------------------------------------------------------------

def flac24_backend():
    """lhotse's libsndfile backend, saving FLAC as 24-bit PCM (lhotse passes no subtype: 16-bit default)."""
    from lhotse.audio.backend import LibsndfileBackend

    class Flac24Backend(LibsndfileBackend):
        def save_audio(self, dest, src, sampling_rate, format=None, encoding=None):
            if (format or "").lower() == "flac" and encoding is None:
                encoding = STORAGE["subtype"]
            super().save_audio(dest, src, sampling_rate, format=format, encoding=encoding)

    return Flac24Backend()


def make_cut(clip: Clip):
    """The lhotse MonoCut of a clip: in-memory 24 kHz recording, a supervision when it has text, custom fields."""
    from lhotse import MonoCut, Recording, SupervisionSegment
    from lhotse.audio import AudioSource

    spec = clip.spec
    duration = clip.num_samples / TARGET_SAMPLE_RATE
    recording = Recording(id=spec.id, sources=[AudioSource(type="memory", channels=[0], source=clip.flac)],
                          sampling_rate=TARGET_SAMPLE_RATE, num_samples=clip.num_samples, duration=duration)
    supervisions = []
    if spec.text is not None:
        supervisions.append(SupervisionSegment(id=spec.id, recording_id=spec.id, start=0.0, duration=duration,
                                               text=spec.text, language=spec.language))
    custom = {"source_id": spec.source_id, "clip": spec.clip, "original_sampling_rate": clip.original_rate,
              "origin": spec.origin}
    if clip.text_tokens is not None:
        custom["text_tokens"] = clip.text_tokens
    if spec.language is not None:
        custom["language"] = spec.language
    if spec.target_language is not None:
        custom["target_language"] = spec.target_language
    if clip.gain != 1.0:
        custom["gain"] = clip.gain
    if clip.source_sha256 is not None:
        custom[shar_format.SOURCE_DIGEST] = clip.source_sha256
    return MonoCut(id=spec.id, start=0.0, duration=duration, channel=0, recording=recording,
                   supervisions=supervisions, custom=custom)


def write_shar_shard(out: Path, index: int, clips: list[Clip]) -> shar_format.ShardRecord:
    """Write shard `index` with lhotse's SharWriter under OUT/.work, then move it into OUT/shar."""
    from lhotse.audio.backend import audio_backend
    from lhotse.shar import SharWriter

    work = shar_format.shard_work_dir(out, index)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    writer = SharWriter(work, fields=dict(shar_format.FIELDS), shard_size=len(clips), shard_offset=index)
    try:
        with audio_backend(flac24_backend()), writer:
            for clip in clips:
                writer.write(make_cut(clip))
        cuts = shar_format.publish_shard(out, index)
    except OSError as err:  # e.g. a full disk: name the shard (lhotse's writer does not) and drop its work dir
        _abandon(writer)
        shutil.rmtree(work, ignore_errors=True)
        raise with_filename(err, work) from None
    duration = sum(c.num_samples for c in clips) / TARGET_SAMPLE_RATE
    return shar_format.shard_record(cuts, len(clips), duration)


def _abandon(writer) -> None:
    """Close every stream of a failed SharWriter, ignoring their errors: lhotse's `close` stops at the first
    writer that fails (a full disk), and a tar stream left open retries its write when it is collected,
    which prints an "Exception ignored" traceback after the run's one-line error."""
    for field_writer in writer.writers.values():
        field_writer = getattr(field_writer, "tar_writer", field_writer)  # an audio field wraps its tar writer
        for stream in (getattr(field_writer, "tarstream", None), getattr(field_writer, "stream", None)):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass  # the shard is being dropped: its bytes do not matter, only that nothing retries


def write_skipped(out: Path, name: str, skipped: list[SkipRecord]) -> None:
    atomic_write_bytes(shar_format.skip_list(out, name), skips.to_lines(skipped))


# --- the run ------------------------------------------------------------------------------------

def describe_inputs(inputs: list[Path], transcripts: Path | None, exclude: Path) -> list[dict]:
    """Input paths (`shown_path`: JSON takes no name that is not UTF-8) with sizes (a directory: its file count
    and total bytes, without the output `exclude` when it lies inside), recorded and checked on resume."""
    described, exclude = [], exclude.resolve()
    for path in [*inputs, *([transcripts] if transcripts else [])]:
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and not p.resolve().is_relative_to(exclude)]
            described.append({"path": shown_path(path.resolve()), "files": len(files),
                              "bytes": sum(p.stat().st_size for p in files)})
        else:
            described.append({"path": shown_path(path.resolve()), "bytes": path.stat().st_size})
    return described


class Conversion:
    """State of one conversion run: the report, the resume cursor, the open shard's buffers."""

    def __init__(self, out: Path, identity: dict, options: ConvertOptions):
        self.out, self.options = out, options
        self.report = self._load_or_start(identity)
        self.shar = out / shar_format.SHAR_DIR
        self.shar.mkdir(parents=True, exist_ok=True)
        self.counts = Counter(self.report.counts)
        self.seen: set[str] = set()
        for shard in self.report.shards:
            cuts_name = shar_format.shard_files(shard.index)[0]
            self.seen.update(cut["id"] for cut in shar_format.read_cut_dicts(self.shar / cuts_name))
        self.buffer: list[Clip] = []
        self.skipped: list[SkipRecord] = []

    def _load_or_start(self, identity: dict) -> shar_format.ConversionReport:
        from mmtok.formats.partdir import identity_difference

        report = shar_format.read_report(self.out)
        if report is not None:
            difference = identity_difference(report.identity, identity)
            if difference:
                raise MmtokError(f"{self.out / shar_format.REPORT}: refusing to resume a conversion with different "
                                 f"settings: {difference}. Rerun with the original inputs/options, or use another "
                                 "--out.")
            return report
        return shar_format.ConversionReport(identity)

    @property
    def next_shard(self) -> int:
        return len(self.report.shards)

    def add(self, result: Clip | SkipRecord) -> None:
        """Count one clip or record of a unit (in, then written or skipped) and buffer it."""
        self.counts["in"] += 1
        if isinstance(result, Clip) and result.spec.id in self.seen:
            result = skip_record(result.spec.id, result.spec.origin, "duplicate_id", "an earlier clip has this cut id")
        if isinstance(result, SkipRecord):
            self.skipped.append(result)
            self.counts[skips.count_key(result.reason)] += 1
            return
        self.seen.add(result.spec.id)
        self.buffer.append(result)
        self.counts["written"] += 1

    def add_inputs(self, collected: Collected) -> None:
        """Count what the inputs skipped or ignored before any unit ran (once, in the final flush)."""
        for record in collected.skipped:
            self.counts["in"] += 1
            self.counts[skips.count_key(record.reason)] += 1
        for extension, count in collected.ignored.items():
            self.counts["in"] += count
            self.counts[f"ignored:{extension}"] += count

    def flush(self, cursor: shar_format.Cursor, *, final: bool = False) -> None:
        """Write the buffered clips as the next shard (and their drops), then record the cursor durably."""
        shards = self.report.shards
        if self.buffer:
            index = self.next_shard
            shards = (*shards, write_shar_shard(self.out, index, self.buffer))
            write_skipped(self.out, f"{index:06d}", self.skipped)
        elif final:
            write_skipped(self.out, "tail", self.skipped)
        self.buffer, self.skipped = [], []
        self.report = replace(self.report, cursor=cursor, shards=shards, counts=dict(sorted(self.counts.items())),
                              complete=final, duration_written=sum(s.duration for s in shards))
        shar_format.write_conversion_report(self.out, self.report)


@dataclass(frozen=True)
class Converted:
    """`convert`'s result: the report written, and whether an earlier run had already completed it."""

    report: shar_format.ConversionReport
    already_done: bool


def convert(inputs: list[Path], out: Path, options: ConvertOptions, *, kind: str = "auto",
            transcripts: Path | None = None, audio_column: str = "audio", text_column: str = "text",
            workers: int = 1, progress: bool = True, allow_command_sources: bool = False,
            media_roots: Sequence[Path] = ()) -> Converted:
    """Convert `inputs` into Lhotse Shar shards under `out`; returns the conversion report (what
    OUT/conversion.json holds) and whether an earlier run had finished the conversion.
    Lhotse `command`/`url` sources are run or fetched only with `allow_command_sources`; conversation audio
    files are read only inside each input's directory or `media_roots`.

    Restartable: shards recorded in OUT/conversion.json are kept; work resumes after the last one.
    One writer per output: OUT is locked for the whole run, and a second run into it is refused at once.
    """
    from mmtok.text import load_text_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    with WriterLock(out, what=f"conversion output {out}"):
        tokenizer = load_text_tokenizer(options.text_tokenizer)
        identity = {"tool": f"mmtok {__version__}", "inputs": describe_inputs(inputs, transcripts, out), "kind": kind,
                    "options": asdict(options), "audio_column": audio_column, "text_column": text_column,
                    "text_tokenizer": tokenizer.describe(), "storage": STORAGE, "resampler": RESAMPLER}
        # what decides which sources are read, recorded (only when set: earlier outputs keep their identity)
        if allow_command_sources:
            identity["allow_command_sources"] = True
        if media_roots:
            identity["media_roots"] = list(check_media_roots(media_roots))
        state = Conversion(out, identity, options)
        if state.report.complete:
            return Converted(state.report, already_done=True)
        collected = collect_units(inputs, kind=kind, transcripts=transcripts, audio_column=audio_column,
                                  text_column=text_column, exclude=out, allow_command_sources=allow_command_sources,
                                  media_roots=media_roots)
        write_skipped(out, "inputs", collected.skipped)
        convert_units(state, collected.units, workers, tokenizer, progress)
        state.add_inputs(collected)
        state.flush(shar_format.Cursor(unit=len(collected.units)), final=True)
        shutil.rmtree(out / shar_format.WORK_DIR, ignore_errors=True)
    return Converted(state.report, already_done=False)


def convert_units(state: Conversion, units: list[Unit], workers: int, tokenizer, progress: bool) -> None:
    """Add every result of `units` after the report's cursor to `state`, flushing each full shard."""
    from mmtok.progress import progress as progress_bar

    options = state.options
    start, skip = state.report.cursor.unit, state.report.cursor.skip
    if start > len(units):  # the inputs are those the report's identity describes: a cursor past them is damage
        raise MmtokError(f"{state.out / shar_format.REPORT}: its cursor is at unit {start:,} of {len(units):,}; "
                         "re-run `mmtok audio convert` into a new --out")
    bar = progress_bar(total=len(units), initial=start, unit="unit", desc="audio convert", enabled=progress)
    for number, results in enumerate(ordered_results(units[start:], options, workers, tokenizer), start):
        first = skip if number == start else 0
        if first > len(results):
            raise MmtokError(f"{state.out / shar_format.REPORT}: its cursor skips {first:,} results of unit "
                             f"{number:,}, which has {len(results):,}; re-run `mmtok audio convert` into a new --out")
        for position in range(first, len(results)):
            state.add(results[position])
            if len(state.buffer) == options.shard_size:
                after = position + 1
                state.flush(shar_format.Cursor(unit=number + (after == len(results)), skip=after % len(results)))
        bar.update(1)
        bar.set_postfix(clips=state.counts["written"], shards=state.next_shard)
    bar.close()
