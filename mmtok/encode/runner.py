"""Images through the rank loop (mmtok.encode.loop): a worker's work items, their pixels, their documents.

A worker (one process per GPU) takes its work items of the plan (`Plan.worker_items`: a contiguous,
cost-balanced range of items for worker w of W) and encodes each into its own part, OUT/parts/part-<item>,
one after another with the codec loaded once. An item already finished is skipped; one a killed worker left
half done resumes from its commit log, whichever worker takes it now, so a job resumes with any number of
workers.

  loader threads  (mmtok.encode.loader)  read, decode, resize and tokenize batch b+1, b+2, ...
  device          (encode.loop)          copies batch b to the device (non-blocking from pinned
                                         memory) and encodes it
  committer       (encode.loop)          turns batch b-1 into documents and items (`Assembler`)
                                         and makes them durable (PartWriter.commit)
Every stage handles batches in global order and everything a commit holds is a function of the plan
alone, so an item's files are the same for any number of loader threads and workers, after any number of
kills and resumes, and merge (in item order) gives the same bytes for any number of workers.

Documents of several images: their images can sit in any batches, on any ranks. Each image is
committed as an item of the part (its block), the document's text template as another (with the
batch of its first image), and `mmtok merge` assembles the document from them (`mmtok.merge.assemble`).
SFT (`--mode sft`): every image is an item and no template is made here; `mmtok sft` renders the
conversations and fills in these images and the conversations' audio (`mmtok.sft.build`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import PIL
import torch

from mmtok import __version__
from mmtok.codecs.base import refuse_low_precision
from mmtok.documents import DocumentBuilder, DocumentError, Template, pack_template
from mmtok.encode.loader import BatchLoader, PreparedBatch
from mmtok.encode.loop import Meter, run_device, uniform_codes
from mmtok.encode.work import ItemWork, load_item_work
from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.formats.chat import recorded_special_ids
from mmtok.formats.commitlog import PartWriter, read_commits
from mmtok.formats.items import CONTAINERS, TEMPLATE_KIND, image_item, image_skip
from mmtok.formats.partdir import NoLock, has_dataset, is_done, part_dir
from mmtok.formats.parts import refuse_other_run, timing_stats
from mmtok.formats.plan import Plan, PlanMetadata
from mmtok.formats.private_parts import adopt_private_part, publish_part
from mmtok.formats.skips import SkipRecord
from mmtok.launch import StopRequest, stop_check
from mmtok.text import TextTokenizer, load_text_tokenizer
from mmtok.vocab import VocabLayout, check_ids_in_range
from mmtok.workers import ItemDone, ItemStop, WorkerRun, take_items


@dataclass
class EncodeOptions:
    loader_threads: int = 4
    prefetch: int = 4  # host memory for batches loaded ahead: prefetch x the largest batch (pinned on CUDA)
    max_consecutive_failures: int = 64  # more undecodable images in a row = a systematic problem: stop
    progress: bool = True
    stop: StopRequest | None = None  # set (a signal came): commit the batch in flight, leave the part unfinished
    take_over: bool = True  # once its own items are done, take any item nobody finished or holds (`items_to_take`)
    lock_free: bool = False  # write a private copy of each item and publish it by a rename (no file locks)


# -- setup -----------------------------------------------------------------------------------------
def plan_tokenizer(plan_meta: PlanMetadata) -> TextTokenizer:
    """The plan's text tokenizer, refused if its files changed since planning."""
    params = plan_meta.parameters
    tokenizer = load_text_tokenizer(params["text_tokenizer"])
    if tokenizer.fingerprint != params.get("text_tokenizer_sha256", tokenizer.fingerprint):
        raise MmtokError(f"text tokenizer {params['text_tokenizer']} changed since planning (sha256 "
                         f"{tokenizer.fingerprint[:12]}..., plan {params['text_tokenizer_sha256'][:12]}...); "
                         "re-run `mmtok plan` with it")
    return tokenizer


def check_codec(work: ItemWork, codec, builder: DocumentBuilder) -> None:
    """The codec must be an image codec with the plan's pixels per code and the plan's block sizes."""
    params = work.plan_meta.parameters
    if codec.modality != "image":
        raise MmtokError(f"codec {codec.name} is an {codec.modality} codec; an image plan needs an image codec")
    if codec.pixels_per_code != params["factor"]:
        raise MmtokError(f"codec {codec.name} has {codec.pixels_per_code} pixels per code but the plan was made "
                         f"with factor {params['factor']}; re-plan with --factor {codec.pixels_per_code}")
    refuse_low_precision(codec.precision.dtype, codec.name)
    rows = work.rows
    shapes = {(int(h), int(w)): int(t)
              for h, w, t in zip(rows["target_height"], rows["target_width"], rows["tokens"], strict=True)}
    factor = codec.pixels_per_code
    for (height, width), tokens in shapes.items():
        have = builder.block_length(height // factor, width // factor)
        if have != tokens:
            raise MmtokError(f"plan counts {tokens} tokens for a {height}x{width} image block but this text tokenizer "
                             f"gives {have}; the plan was made with another tokenizer -- re-run `mmtok plan`")


def image_part_identity(work: ItemWork, codec, tokenizer: TextTokenizer, layout: VocabLayout) -> dict:
    """What a part is made from; a resume must match it exactly (see PartWriter)."""
    special = recorded_special_ids(tokenizer)
    return {
        "part": work.item, "num_parts": work.num_items, "modality": "image", "mode": work.mode,
        "part_batches": list(work.batch_range),
        "work_items": {"count": work.num_items, "target_cost": work.plan_meta.work_items.target_cost},
        "plan_fingerprint": work.plan_meta.fingerprint,
        "manifest_fingerprint": work.plan_meta.manifest_fingerprint,
        "codec": codec.describe(),
        # Pillow's bicubic resize changed in 13.0 (values differ by up to 3/255): ranks decoding with another
        # Pillow would write other tokens, so a resume or a merge across versions is refused.
        "image_decoder": {"pillow": PIL.__version__},
        "text_tokenizer": tokenizer.describe(),
        "text_special_ids": special,
        "vocab": layout.offsets(),
        CONTAINERS: work.containers,  # the tars as scanned: sft and merge check them before using the items
    }


# -- documents -------------------------------------------------------------------------------------
@dataclass
class Commit:
    sequences: list[np.ndarray] = field(default_factory=list)
    provenance: list[dict] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    skipped: list[SkipRecord] = field(default_factory=list)
    items: list[tuple[dict, np.ndarray]] = field(default_factory=list)


class Assembler:
    """Encoded batches -> what their commits hold, a function of the batch alone.

    A one-image document becomes its sequence (or its skip record) at once. A document of several
    images may have them on several ranks: each image becomes an *image item* (its block, or why it
    failed) and the document's template a *template item* (with the batch of its first image); merge
    assembles those (`mmtok.merge.assemble`), so no rank waits for another and any batch boundary is a cut.
    """

    def __init__(self, work: ItemWork, builder: DocumentBuilder, codebook_size: int):
        """`codebook_size`: the codec's, within the vocabulary's image block (a plugin's may be smaller)."""
        self.work = work
        self.builder = builder
        self.codebook_size = codebook_size
        self.consecutive_failures = 0

    def add(self, prepared: PreparedBatch, codes: np.ndarray | None, max_failures: int) -> Commit:
        rows, commit = self.work.rows, Commit()
        if codes is not None:
            kept = [codes[slot] for slot, failure in enumerate(prepared.failures) if not failure]
            commit.counts.update(uniform_codes(kept))
        for slot, row in enumerate(range(prepared.rows.start, prepared.rows.stop)):
            failure = prepared.failures[slot]
            self._count_failure(failure, row, max_failures)
            block = None if failure else self._block(codes[slot], row)
            if rows["document_images"][row] == 1 and self.builder.makes_documents:
                template = prepared.templates.get(int(rows["document"][row]))
                if template is None:  # a kept document always keeps its image 0 (documents are dropped whole)
                    raise MmtokError(f"plan row of manifest row {rows['manifest_row'][row]}: a one-image document "
                                     f"whose image has image_index {rows['image_index'][row]}, not 0; the plan does "
                                     "not match this mmtok -- re-run `mmtok plan`")
                self._one_image_document(row, failure, block, template, commit)
            else:
                commit.items.append(image_item(self.sample(row), failure, block, prepared.digests[slot]))
                commit.counts["images_deferred"] += 1
                if failure:  # the item says why; counted here too so the summary and status show it now
                    commit.counts[skips.item_failed_key(failure.reason)] += 1
        for row in self.work.template_rows(prepared.batch) if self.builder.makes_documents else ():
            if rows["document_images"][row] > 1:
                commit.items.append(self._template_item(row, prepared.templates[int(rows["document"][row])]))
        if commit.items:  # image blocks and template ids, the tokens merge assembles into documents
            commit.counts["item_tokens"] += sum(int(ids.size) for _record, ids in commit.items)
        return commit

    def _block(self, codes: np.ndarray, row: int) -> np.ndarray:
        r = self.work.rows  # the last guard: no code outside the image codebook reaches a commit
        check_ids_in_range(codes, 0, self.codebook_size,
                           f"image codes of {r['tar'][row]} member {r['member'][row]} "
                           f"(manifest row {r['manifest_row'][row]})")
        block = self.builder.image_block(codes)
        if block.size != self.work.rows["tokens"][row]:
            raise MmtokError(f"image block of manifest row {self.work.rows['manifest_row'][row]} has {block.size} "
                             f"tokens, the plan counted {self.work.rows['tokens'][row]}")
        return block

    def _count_failure(self, reason: Skip | None, row: int, limit: int) -> None:
        self.consecutive_failures = self.consecutive_failures + 1 if reason else 0
        if self.consecutive_failures > limit:
            r = self.work.rows
            raise MmtokError(
                f"{self.consecutive_failures} images in a row failed to decode (last: {r['tar'][row]} member "
                f"{r['member'][row]}: {reason}). This looks systematic (wrong or damaged input files, a copy "
                f"that differs from what was scanned), not a few bad images; check the inputs and re-scan. "
                f"(--max-consecutive-failures raises the limit.)")

    def _one_image_document(self, row: int, failure: Skip | None, block: np.ndarray | None,
                            template: Template | DocumentError, commit: Commit) -> None:
        skip = failure or (template if isinstance(template, DocumentError) else None)
        if skip is not None:
            commit.counts[skips.count_key(skip.reason)] += 1
            commit.counts["documents_skipped"] += 1
            commit.skipped.append(image_skip(self.sample(row), skip, "encode"))
            return
        tokens = self.builder.assemble(template, {0: block})
        r = self.work.rows
        commit.sequences.append(tokens)
        commit.provenance.append({"document": int(r["document"][row]), "key": r["key"][row], "tar": r["tar"][row],
                                  "rows": [int(r["manifest_row"][row])]})
        commit.counts.update(images_written=1, documents_written=1, tokens=int(tokens.size))

    def sample(self, row: int) -> dict:
        """Which sample plan row `row` is and where it lives (the fields of its image item)."""
        r = self.work.rows
        return {"key": r["key"][row], "source": r["tar"][row], "container": r["container"][row],
                "member": r["member"][row], "manifest_row": int(r["manifest_row"][row]),
                "document": int(r["document"][row]), "image_index": int(r["image_index"][row])}

    def _template_item(self, row: int, template: Template | DocumentError) -> tuple[dict, np.ndarray]:
        r = self.work.rows
        record = {"kind": TEMPLATE_KIND, "document": int(r["document"][row]), "key": r["key"][row],
                  "tar": r["tar"][row], "num_images": int(r["document_images"][row])}
        if isinstance(template, DocumentError):
            record.update(skip=template.reason, detail=template.detail)
            return record, np.zeros(0, np.int32)
        ids, record["layout"] = pack_template(template)
        return record, ids


# -- the worker ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageWorkerRun(WorkerRun):
    """What an image worker did (`encode_image_rank`): its items summed, and its pace."""

    rank: int
    world_size: int
    mode: str  # the plan's
    items_done_before: int  # items it found finished
    dataset: bool  # some part it reached has a Megatron dataset
    images_planned: int  # in the items it reached
    fill_s: float  # seconds the device waited for its first batch, summed over the items it encoded now
    device: str
    loader_threads: int

    @property
    def images_written(self) -> int:
        return self.counts.get("images_written", 0)

    @property
    def images_deferred(self) -> int:
        """Images stored as items: merge (or mmtok sft) assembles their documents."""
        return self.counts.get("images_deferred", 0)

    @property
    def timing(self) -> dict[str, float]:
        """Wall and device-busy seconds of the parts reached (every session), their ratio, tokens per second."""
        return timing_stats(self.counts)

    @property
    def images_per_s(self) -> float:
        wall = self.timing["wall_s"]
        return (self.images_written + self.images_deferred) / wall if wall else 0.0

    def to_json(self) -> dict:
        counts = self.counts
        return {**super().to_json(), "rank": self.rank, "world_size": self.world_size, "mode": self.mode,
                "items_done_before": self.items_done_before, "dataset": self.dataset,
                "images_planned": self.images_planned, "images_written": self.images_written,
                "images_deferred": self.images_deferred, "items_failed": skips.items_failed_by_reason(counts),
                "skipped": skips.by_reason(counts), **self.timing, "images_per_s": self.images_per_s,
                "fill_s": self.fill_s, "device": self.device, "loader_threads": self.loader_threads}


def encode_image_rank(plan_dir: str | Path, out: str | Path, codec, *, rank: int, world_size: int,
                      device: torch.device | str = "cpu", options: EncodeOptions | None = None) -> ImageWorkerRun:
    """Worker `rank` of `world_size`: encode its work items (`Plan.worker_items`) into OUT/parts/part-<item>;
    returns what it did, summed over its items.

    Each part is created or resumed (refusing a different plan, codec or precision), its batches not yet
    committed are encoded, and it is finished (tokens.idx, stats.json, DONE); a finished part is left as it is.
    Then, with `options.take_over` (the default), it takes the items no process has finished or holds, from the
    far end (`mmtok.workers.items_to_take`): a slow or dead worker's remaining items are done by those
    that finished, and an own item another worker holds is left to it (`TakeOver.taken_over`, `held_by_others`);
    without it, a held item is an error naming the holder. Once `options.stop` is set the worker
    commits the batch in flight and returns with its part unfinished (`WorkerRun.stopped`: the signal, the item
    and the next batch to encode; None when every item was finished).
    """
    options = options or EncodeOptions()
    encoder = ItemEncoder(plan_dir, out, codec, device, options)
    plan, device = encoder.plan, encoder.device
    items = plan.worker_items(rank, world_size)
    run = take_items(out, len(plan.work_items()), items, options.take_over, stop_check(options.stop), encoder.encode)
    stopped = None
    if run.stopped is not None:  # inside the item (its result says where), or before it
        inside = run.reached and run.reached[-1] == run.stopped
        stopped = ItemStop(signal=options.stop.name, item=run.stopped,
                           next_batch=run.done[-1].next_unit if inside else _next_batch(plan, out, run.stopped))
    discarded = [item for item, done in zip(run.reached, run.done, strict=True) if done.discarded]
    ran = [done for done in run.done if not done.already_done]
    return ImageWorkerRun.of(
        run, items, len(plan.work_items()), out, stopped, discarded, rank=rank, world_size=world_size,
        mode=plan.meta.parameters["mode"],
        items_done_before=len(run.done) - len(ran), dataset=any(done.dataset for done in run.done),
        images_planned=sum(done.planned for done in run.done), fill_s=sum(done.fill_s for done in ran),
        device=str(device), loader_threads=options.loader_threads)


class ItemEncoder:
    """Encodes work items of one plan into OUT with one loaded codec, item by item in any order: what a worker
    process holds (`encode_image_rank`'s workers, a Ray actor of `mmtok.encode.ray_driver`)."""

    def __init__(self, plan_dir: str | Path, out: str | Path, codec, device: torch.device | str,
                 options: EncodeOptions):
        self.out, self.codec, self.options = out, codec, options
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before the pinned ring: its context belongs on this GPU, not cuda:0
        self.plan = Plan.open(plan_dir)
        refuse_empty_plan(self.plan)
        self.tokenizer = plan_tokenizer(self.plan.meta)
        self.layout = VocabLayout(text_size=self.tokenizer.vocab_size)
        self.builder = DocumentBuilder(self.plan.meta.parameters["mode"], self.tokenizer, self.layout)
        codec.precision.apply()  # before any encoding; recorded in the identity via codec.describe()
        self._checked = False  # whether the run's other parts were compared with this identity (once, when known)

    def encode(self, item: int, lock_free: bool | None = None) -> ItemDone:
        """Encode, resume or find finished the part of `item` (`lock_free`: this call's part protocol; default the
        options')."""
        work = load_item_work(self.plan, item)
        check_codec(work, self.codec, self.builder)
        identity = image_part_identity(work, self.codec, self.tokenizer, self.layout)
        if not self._checked:  # every key now the codec is loaded (its checkpoint, the tokenizer, ...)
            refuse_other_run(self.out, identity)
            self._checked = True
        options = self.options if lock_free is None else replace(self.options, lock_free=lock_free)
        return _encode_item(work, self.out, self.codec, self.builder, identity, self.device, options)


def _next_batch(plan: Plan, out, item: int) -> int:
    """The first batch of `item` its part has not committed (its first batch when it has no commit)."""
    start = int(plan.work_items()[item][0])
    try:
        records, _ = read_commits(part_dir(out, item))
    except (MmtokError, OSError):  # unreadable: the resume says why
        return start
    return max(start, records[-1]["unit"] + 1) if records else start


def refuse_empty_plan(plan: Plan) -> None:
    """Nothing from nothing: a plan that keeps no image is refused rather than encoded into empty parts."""
    if not plan.meta.totals.kept_images:
        raise MmtokError(f"{plan.directory}: the plan keeps no image (see `mmtok plan --explain` and its "
                         "dropped.parquet for why); re-plan with other limits -- nothing to encode")


def _encode_item(work: ItemWork, out, codec, builder: DocumentBuilder, identity: dict, device: torch.device,
                 options: EncodeOptions) -> ItemDone:
    """Encode (or resume, or find finished) one work item's part. Lock-free (`options.lock_free`): in this writer's
    private copy, published when finished (`publish_part`; `discarded` when another writer's identical copy was
    published first)."""
    final = part_dir(out, work.item)
    private = options.lock_free and not is_done(final)  # lock-free and not published yet: this writer's copy
    directory = adopt_private_part(out, work.item) if private else final
    with PartWriter(directory, identity, lock=NoLock() if options.lock_free else None) as part:
        if part.done and not private:  # a finished part: read, never written
            return _item_done(part, final, work, already_done=True)
        fill_s = 0.0
        if not part.done:  # (a private copy finished by a writer killed before it published it: publish it)
            start = max(work.batch_range[0], part.next_unit)
            assembler = Assembler(work, builder, min(codec.codebook_size, builder.layout.image_codebook))
            batches = range(start, work.batch_range[1])
            meter = _run_batches(work, codec, part, assembler, batches, device, options)
            fill_s = meter.fill_seconds
            if part.next_unit < work.batch_range[1]:  # a stop request: what was encoded is committed, not finished
                return _item_done(part, part.directory, work, stopped=True, next_unit=part.next_unit, fill_s=fill_s)
            part.finish({**_stats(part, codec, device, options, work), "fill_s": fill_s})
        done = _item_done(part, final, work, fill_s=fill_s)
    if private:
        discarded = not publish_part(directory, final)  # (first: the dataset is looked for where it is published)
        done = replace(done, dataset=has_dataset(final), discarded=discarded)
    return done


def _item_done(part: PartWriter, final: Path, work: ItemWork, **fields) -> ItemDone:
    """What the item's part holds (`final`: where it is published, the part itself unless lock-free)."""
    return ItemDone(part_dir=str(final), counts=dict(part.counts), sequences=len(part.lengths),
                    dataset=has_dataset(part.directory), planned=work.num_images, **fields)


def _run_batches(work: ItemWork, codec, part: PartWriter, assembler: Assembler, batches: range,
                 device: torch.device, options: EncodeOptions) -> Meter:
    from mmtok.progress import progress as progress_bar

    pin = device.type == "cuda" and torch.cuda.is_available()
    bar = progress_bar(total=work.num_images, desc=f"encode item {work.item}", unit="img", enabled=options.progress,
                       mininterval=1.0)
    meter = Meter(bar, work.images_before(batches.start), item="img")
    loader = BatchLoader(work, assembler.builder, batches, threads=options.loader_threads,
                         prefetch=options.prefetch, pin=pin)
    try:
        run_device(loader, lambda prepared: _encode(codec, prepared, device),
                   lambda prepared, codes: _commit(part, assembler, prepared, codes, meter, options),
                   meter, release=loader.release, stop=stop_check(options.stop))
    finally:
        loader.close()
        bar.close()
    return meter


def _encode(codec, prepared: PreparedBatch, device: torch.device) -> np.ndarray | None:
    """Codes [B, h, w] of a batch (None when every image failed: nothing to encode)."""
    if all(prepared.failures):
        return None
    pixels = prepared.pixels.to(device, non_blocking=True)  # async from pinned memory on CUDA
    return codec.encode(pixels).cpu().numpy()  # .cpu() waits for the device


def _commit(part: PartWriter, assembler: Assembler, prepared: PreparedBatch, codes: np.ndarray | None,
            meter: Meter, options: EncodeOptions) -> None:
    commit = assembler.add(prepared, codes, options.max_consecutive_failures)
    tokens = commit.counts.get("tokens", 0) + commit.counts.get("item_tokens", 0)  # items are encoded tokens too
    timing = meter.committed(len(prepared.failures), int(tokens))
    part.commit(prepared.batch, commit.sequences, commit.provenance, {**commit.counts, **timing},
                skipped=commit.skipped, items=commit.items)


def _stats(part: PartWriter, codec, device: torch.device, options: EncodeOptions, work: ItemWork) -> dict:
    counts = part.counts
    timing = timing_stats(counts)
    return {
        "tool_version": __version__,
        "item": work.item, "num_items": work.num_items, "mode": work.mode, "batches": list(work.batch_range),
        "images_planned": work.num_images,
        "images_written": counts.get("images_written", 0),
        "images_deferred": counts.get("images_deferred", 0),  # items: merge (or mmtok sft) assembles their documents
        "items_failed": skips.items_failed_by_reason(counts),
        "skipped": skips.by_reason(counts),
        **timing,
        "images_per_s": (counts.get("images_written", 0) + counts.get("images_deferred", 0)) / timing["wall_s"]
        if timing["wall_s"] else 0.0,
        "device": str(device), "loader_threads": options.loader_threads,
        "precision": codec.precision.to_dict(),
    }
