"""`mmtok dedup`: duplicate groups over the hash tables of several sources; the list `mmtok plan --exclude` drops."""

from __future__ import annotations

from pathlib import Path

from mmtok.commands.report import plural, print_summary


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "dedup", help="find duplicate images across sources from their hash tables (for `mmtok plan --exclude`)",
        description="Group the images of one or more hash tables (`mmtok hash`, one per source) into duplicates: "
        "equal bytes (sha256) always; equal pHashes, or pHashes within a Hamming radius, as each source's rule in "
        "the policy says. Each group keeps one image, the first by (source priority, most pixels, source name, "
        "sample key), whatever the order of the inputs; every other image is listed in OUT/dropped.parquet with "
        "its group, keeper, rule and distance. Policy (YAML): `sources: {laion: {rule: exact}, ego4d: {rule: radius, "
        "radius: 4}, docvqa: {rule: off}}`, `priority: N` optional (default: the order in the file; lower "
        "wins). See docs/curation.md.")
    parser.add_argument("hashes", nargs="+", type=Path, metavar="HASHES", help="hash table directories (`mmtok hash`)")
    parser.add_argument("--policy", type=Path, required=True, metavar="FILE", help="per-source rules (YAML)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.curate.dedup import dedup
    from mmtok.fsutil import refuse_out_overlapping

    refuse_out_overlapping(args.out, [*args.hashes, args.policy])
    meta = dedup(args.hashes, args.policy, args.out)
    print_summary("dedup", summary_lines(meta, args.out))
    return 0


def summary_lines(meta: dict, out: Path) -> list[str]:
    """One line per source (hashed = kept + dropped, by rule), then the totals and where the list is."""
    lines = []
    for source, counts in meta["counts"].items():
        rules = ", ".join(f"{rule} {n:,}" for rule, n in counts["by_rule"].items() if n)
        rule = meta["policy"][source]
        lines.append(f"{source} ({rule['rule']}{' ' + str(rule['radius']) if rule['rule'] == 'radius' else ''}, "
                     f"priority {rule['priority']}): {counts['hashed']:,} hashed = {counts['kept']:,} kept + "
                     f"{counts['dropped']:,} dropped{f' ({rules})' if rules else ''}")
    total = sum(c["hashed"] for c in meta["counts"].values())
    head = (f"{plural(meta['dropped'], 'duplicate')} in {plural(meta['groups'], 'group')} among "
            f"{plural(total, 'image')} of {plural(len(meta['counts']), 'source')}")
    return [head, *lines, f"wrote {out / 'dropped.parquet'}; drop them with `mmtok plan MANIFEST --exclude {out}`"]
