"""`mmtok codec encode|decode`: run one codec on one input, to eyeball a checkpoint.

Images: INPUT is an image file (decoded, oriented, converted to RGB and resized by the plan's rule
with --min-pixels/--max-pixels) or a `.npy` uint8 HWC array already at a multiple of the codec's
pixels per code (encoded as is). Audio: INPUT is an audio file (mono, resampled to the codec's rate,
peak-normalized as the pipeline does) or a `.npy` float32 1-D waveform at the codec's rate (encoded
as is). Codes are written as `.npy` (int32, [h, w] for images, [n] for audio, untrimmed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mmtok.commands.options import add_device_argument
from mmtok.commands.report import plural, print_summary
from mmtok.errors import MmtokError


def add_parser(sub) -> None:
    parser = sub.add_parser("codec", help="encode or decode one input with a codec checkpoint",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    codec_sub = parser.add_subparsers(dest="codec_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("encode", "INPUT (image/audio file or .npy) -> codes .npy"),
                       ("decode", "codes .npy -> image (.png/.npy) or audio (.wav/.npy)")):
        child = codec_sub.add_parser(name, help=text, description=text)
        child.add_argument("--codec", required=True,
                           help="a registered codec: emu3.5, emu3, wavtokenizer, or a plugin's (docs/write-a-codec.md)")
        child.add_argument("--checkpoint", required=True, help="directory with the official checkpoint files")
        add_device_argument(child)
        child.add_argument("input", help="input file")
        child.add_argument("--out", required=True, help="output file")
        if name == "encode":
            child.add_argument("--min-pixels", type=int, default=256 * 256,
                               help="image files: lower pixel bound of the resize rule (default 65536)")
            child.add_argument("--max-pixels", type=int, default=1024 * 1024,
                               help="image files: upper pixel bound of the resize rule (default 1048576)")
        child.set_defaults(func=run)


def run(args) -> int:
    import torch

    from mmtok.codecs.registry import load_codec
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.launch import resolve_device
    from mmtok.vocab import check_ids_in_range

    refuse_out_overlapping(args.out, [args.input, args.checkpoint])
    codec = load_codec(args.codec, args.checkpoint, resolve_device(args.device))
    codec.precision.apply()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        if args.codec_command == "encode":
            codes = _encode(codec, args)
            check_ids_in_range(codes, 0, codec.codebook_size, f"codec {codec.name}: the codes of {args.input}")
            np.save(out, codes)
            print_summary("codec encode",
                          f"{args.input}: {plural(codes.size, 'code')}, shape {list(codes.shape)} -> {out}")
        else:
            _decode(codec, np.load(args.input), out)
            print_summary("codec decode", f"{args.input} -> {out}")
    return 0


def _encode(codec, args) -> np.ndarray:
    import torch

    device = codec.device
    if codec.modality == "image":
        pixels = _image_input(args.input, codec.pixels_per_code, args.min_pixels, args.max_pixels)
        batch = torch.tensor(pixels[None], device=device)  # a copy: PIL-backed arrays are read-only
        return codec.encode(batch)[0].cpu().numpy().astype(np.int32)
    wave = _audio_input(args.input, codec.sample_rate)
    batch = torch.from_numpy(wave[None]).to(device)
    codes, counts = codec.encode(batch, torch.tensor([wave.size], device=device))
    return codes[0, : int(counts[0])].cpu().numpy().astype(np.int32)


def _image_input(path: str, factor: int, min_pixels: int, max_pixels: int) -> np.ndarray:
    from mmtok.media.images import ImageDecodeError, load_rgb_file, resize_rgb
    from mmtok.media.resize import target_shape

    if path.endswith(".npy"):
        pixels = np.load(path)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise MmtokError(f"{path}: expected a uint8 [H, W, 3] array, got {pixels.dtype} {pixels.shape}")
        if pixels.shape[0] % factor or pixels.shape[1] % factor:
            raise MmtokError(f"{path}: {pixels.shape[0]}x{pixels.shape[1]} is not a multiple of {factor}; "
                             "pass an image file to have it resized")
        return pixels
    try:
        image = load_rgb_file(path)
    except ImageDecodeError as err:
        raise MmtokError(f"{path}: {err}") from None
    height, width = target_shape(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels,
                                 factor=factor)
    return resize_rgb(image, height, width)


def _audio_input(path: str, sample_rate: int) -> np.ndarray:
    from mmtok.media.audio import AudioReason, load_audio, peak_normalize

    if path.endswith(".npy"):
        wave = np.load(path)
        if wave.dtype != np.float32 or wave.ndim != 1:
            raise MmtokError(f"{path}: expected a float32 1-D waveform at {sample_rate} Hz, "
                             f"got {wave.dtype} {wave.shape}")
        return wave
    try:
        wave, _ = load_audio(path, sample_rate)
        return peak_normalize(wave)
    except AudioReason as err:
        raise MmtokError(f"{path}: {err}") from None


def _decode(codec, codes: np.ndarray, out: Path) -> None:
    import torch

    device = codec.device
    decoded = codec.decode(torch.from_numpy(codes.astype(np.int64)[None]).to(device)).float().cpu().numpy()
    if out.suffix == ".npy":
        np.save(out, decoded)
    elif codec.modality == "image":
        from PIL import Image

        pixels = np.clip((decoded[0].transpose(1, 2, 0) + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(out)
    else:
        import soundfile

        soundfile.write(out, decoded[0], codec.sample_rate, subtype="FLOAT")
