"""`mmtok dedup`: duplicate groups over the hash tables of several sources; the list `mmtok plan --exclude` drops."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import plural, print_summary

if TYPE_CHECKING:  # the list's types; pyarrow is imported when a list is made
    from mmtok.formats.dedup import DecontaminationRecord, DedupMetadata


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "dedup", help="find duplicate images across sources from their hash tables (for `mmtok plan --exclude`)",
        description="Group the images of one or more hash tables (`mmtok hash`, one per source) into duplicates: "
        "equal bytes (sha256) always; equal pHashes, or pHashes within a Hamming radius, as each source's rule in "
        "the policy says. Each group keeps one image, the first by (source priority, most pixels, source name, "
        "sample key), whatever the order of the inputs; every other image is listed in OUT/dropped.parquet with "
        "its group, keeper, rule and distance. Policy (YAML): `sources: {laion: {rule: exact}, ego4d: {rule: radius, "
        "radius: 4}, docvqa: {rule: off}}`, `priority: N` optional (default: the order in the file; lower "
        "wins). Decontamination (--against): every image whose bytes equal a benchmark image's, or whose pHash is "
        "within its source's `decontaminate: R` (default 4; `off`: bytes only) of one, is dropped by sample id, "
        "named with the benchmark image and the distance -- except suspect matches (a benchmark image matching "
        "over `max_matches` images, a source with over `max_share` of its images flagged: low-entropy domains), "
        "which are held back in OUT/held.parquet until --confirm names them. Captions (measured by `mmtok hash`): "
        "a phrase looping, a runaway number list, the last sentence repeated, a prompt fragment "
        "(`mmtok hash --prompt-fragments`), one template over a share of a source -- thresholds in the policy's "
        "`captions:` (defaults: loop 4, number_run 16, ending 2, template_share 0.5 of sources with at least "
        "template_min 1000 captions; `off` disables one, a source's `captions: off` all). See docs/curation.md.")
    parser.add_argument("hashes", nargs="+", type=Path, metavar="HASHES", help="hash table directories (`mmtok hash`)")
    parser.add_argument("--policy", type=Path, required=True, metavar="FILE", help="per-source rules (YAML)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument("--against", type=Path, action="append", default=[], metavar="BENCH",
                        help="a benchmark's hash table (`mmtok hash BENCH_MANIFEST --source BENCHMARK_NAME`), "
                        "repeatable: drop the training images that match its images")
    parser.add_argument("--confirm", action="append", default=[], metavar="NAME",
                        help="drop the held-back matches of a suspect benchmark image (BENCHMARK:KEY) or of a "
                        "suspect source (its name), repeatable; the summary names the suspects")
    parser.add_argument("--report", action="store_true",
                        help="also write OUT/report/: index.md with the per-source counts and PNG contact sheets of "
                        "sampled duplicate groups (keeper first), every benchmark match beside its benchmark image, "
                        "the matches held back, and the caption-flagged images with their captions")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.curate.dedup import dedup
    from mmtok.errors import MmtokError
    from mmtok.fsutil import refuse_out_overlapping

    refuse_out_overlapping(args.out, [*args.hashes, args.policy, *args.against])
    if args.confirm and not args.against:
        raise MmtokError("--confirm confirms benchmark matches: give the benchmarks with --against")
    meta = dedup(args.hashes, args.policy, args.out, args.against, args.confirm)
    lines = summary_lines(meta, args.out)
    if args.report:
        from mmtok.curate.report import REPORT_DIR, write_curation_report

        report = write_curation_report(args.out)
        unshown = f"; {plural(len(report['unshown']), 'image')} could not be shown (named there)" \
            if report["unshown"] else ""
        lines.append(f"report: {args.out / REPORT_DIR / 'index.md'} ({plural(len(report['sheets']), 'contact sheet')}, "
                     f"{plural(report['shown'], 'image')}{unshown})")
    print_summary("dedup", lines)
    return 0


def summary_lines(meta: DedupMetadata, out: Path) -> list[str]:
    """One line per source (hashed = kept + dropped, by rule; held matches), the suspects held back, then the
    totals and where the lists are."""
    lines = []
    for source, counts in meta.counts.items():
        rules = ", ".join(f"{rule} {n:,}" for rule, n in counts.by_rule.items() if n)
        rule = meta.policy[source]
        held = f"; {plural(counts.held, 'benchmark match', 'benchmark matches')} held back (kept)" \
            if counts.held else ""
        lines.append(f"{source} ({rule.rule}{' ' + str(rule.radius) if rule.rule == 'radius' else ''}, "
                     f"priority {rule.priority}): {counts.hashed:,} hashed = {counts.kept:,} kept + "
                     f"{counts.dropped:,} dropped{f' ({rules})' if rules else ''}{held}")
    total = sum(c.hashed for c in meta.counts.values())
    decontamination = meta.decontamination
    matching = decontamination.contaminated if decontamination else 0
    flagged = meta.captions.flagged
    parts = [f"{plural(meta.dropped - matching - flagged, 'duplicate')} in {plural(meta.groups, 'group')}"]
    if decontamination:
        parts.append(f"{plural(matching, 'image')} matching {plural(len(decontamination.against), 'benchmark')}")
    if flagged:
        parts.append(f"{plural(flagged, 'image')} flagged by {'its caption' if flagged == 1 else 'their captions'}")
    head = (", ".join(parts[:-1]) + " and " if len(parts) > 1 else "") + parts[-1] \
        + f" among {plural(total, 'image')} of {plural(len(meta.counts), 'source')}"
    lines = [head, *lines, *(_suspect_lines(decontamination) if decontamination else [])]
    held = f" and the held-back matches in {out / 'held.parquet'}" if decontamination else ""
    return lines + [f"wrote {out / 'dropped.parquet'}{held}; drop them with `mmtok plan MANIFEST --exclude {out}`"]


def _suspect_lines(decontamination: DecontaminationRecord) -> list[str]:
    """Why matches were held back, each with the flag that drops them."""
    guards = decontamination.guards
    lines = [f"held back: benchmark image {item.benchmark} matches {item.matches:,} training images (more than "
             f"max_matches {guards.max_matches}: likely a low-entropy image, not a copy); to drop them anyway: "
             f"--confirm {item.benchmark}" for item in decontamination.suspect_images[:SHOWN]]
    lines += [f"held back: source {item.source} has {item.flagged:,} of {item.hashed:,} images matching "
              f"benchmarks (over max_share {guards.max_share:g}: a low-entropy domain, or a benchmark's own "
              f"source); to drop them anyway: --confirm {item.source}"
              for item in decontamination.suspect_sources]
    more = len(decontamination.suspect_images) - SHOWN
    if more > 0:
        lines.append(f"... and {plural(more, 'more suspect benchmark image')} (dedup.json `decontamination`)")
    if decontamination.confirmed:
        lines.append(f"confirmed by --confirm: {', '.join(decontamination.confirmed)}")
    return lines


SHOWN = 10  # suspect benchmark images named in the summary (all are in dedup.json)
