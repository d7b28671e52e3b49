"""The golden codec sets kept in the repository (tests/golden/, README there) in a compact form, and
their expansion back into the official checkpoint files the codecs load.

A compact checkpoint folder holds the checkpoint's small text files unchanged, `weights.json` (every
tensor's key, dtype, shape, stride and storage, in the original order; constant-filled storages as one
value) and `weights.npz` (the other storages' raw bytes, byte-planes split so that deflate finds the
repeated sign/exponent bytes). Expanding rebuilds the same tensors and writes them with the writer the
original used (torch.save or safetensors), then checks the tensors' digest recorded when packing.

    python tests/goldenkit.py pack SET_DIR OUT_DIR    # an original set folder -> its compact form
    python tests/goldenkit.py expand OUT_DIR TARGET   # the compact form -> an original-looking folder
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

COMPACT_ROOT = Path(__file__).resolve().parent / "golden"
WEIGHT_FILES = ("model.ckpt", "model.safetensors")
# What each test module reads of a set; everything else of the original sets stays out of the repository.
USED_ARRAYS = {
    "emu35": ("inputs_uint8", "codes", "decoded", "latents"),
    "emu3": ("inputs_uint8", "pixel_values", "codes", "latents", "decoded", "decoded_frames", "video",
             "preprocess_cases"),
    "wavtokenizer": ("inputs_24k", "codes_single", "codes_batched", "encoder_out", "distance_margin", "decoded"),
}


def _storage_bytes(tensor: torch.Tensor) -> np.ndarray:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy().copy()


def _digest(entries: list[dict], storages: dict[str, np.ndarray]) -> str:
    """sha256 over every tensor's key, dtype, shape, stride, offset and storage bytes, in order."""
    h = hashlib.sha256()
    for entry in entries:
        h.update(json.dumps([entry[k] for k in ("key", "dtype", "shape", "stride", "offset")]).encode())
        h.update(storages[entry["key"]].tobytes())
    return h.hexdigest()


def _read_weights(path: Path) -> tuple[dict, collections.OrderedDict]:
    """(the container around the state dict, the state dict) of an original weights file."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        return {"writer": "safetensors", "metadata": metadata}, collections.OrderedDict(load_file(str(path)))
    checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    state = checkpoint["state_dict"]
    others = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    modules = [[name, info] for name, info in getattr(state, "_metadata", {}).items()]
    return {"writer": "torch.save", "container": others, "module_metadata": modules}, state


def pack_weights(path: Path, out: Path) -> None:
    """Write `weights.json` + `weights.npz` into `out` for the original weights file `path`."""
    container, state = _read_weights(path)
    entries, storages, stored = [], {}, {}
    for key, tensor in state.items():
        raw = _storage_bytes(tensor)
        values = raw.view(tensor.numpy().dtype)
        entry = {"key": key, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                 "stride": list(tensor.stride()), "offset": tensor.storage_offset(), "storage": len(values)}
        if len(values) and (values == values[0]).all():
            entry["fill"] = values[0].item()  # float32 -> Python float and back is exact
        else:
            stored[key] = raw.reshape(len(values), -1).T.copy()  # byte planes, deflated below
        storages[key] = raw
        entries.append(entry)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "weights.npz", **stored)
    header = {"file": path.name, **container, "tensors_sha256": _digest(entries, storages), "tensors": entries}
    (out / "weights.json").write_text(json.dumps(header, indent=1) + "\n")


def expand_weights(compact: Path, target: Path) -> Path:
    """Rebuild the original weights file from `compact` (a folder with weights.json/.npz) into `target`."""
    header = json.loads((compact / "weights.json").read_text())
    state, storages = collections.OrderedDict(), {}
    with np.load(compact / "weights.npz") as stored:
        for entry in header["tensors"]:
            dtype = getattr(torch, entry["dtype"])
            if "fill" in entry:
                values = torch.full((entry["storage"],), entry["fill"], dtype=dtype)
            else:
                values = torch.from_numpy(stored[entry["key"]].T.copy().reshape(-1)).view(dtype)
            storages[entry["key"]] = values.view(torch.uint8).numpy()
            state[entry["key"]] = torch.empty(0, dtype=dtype).set_(
                values.untyped_storage(), entry["offset"], entry["shape"], entry["stride"])
    if _digest(header["tensors"], storages) != header["tensors_sha256"]:
        raise AssertionError(f"{compact}: the rebuilt tensors differ from the packed ones")
    path = target / header["file"]
    if header["writer"] == "safetensors":
        from safetensors.torch import save_file

        save_file(dict(state), str(path), metadata=header["metadata"])
    else:
        if header["module_metadata"]:
            state._metadata = collections.OrderedDict((name, info) for name, info in header["module_metadata"])
        torch.save({**header["container"], "state_dict": state}, path)
    return path


def pack(source: Path, out: Path) -> None:
    """An original set folder -> its compact form (only the arrays the tests read)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in USED_ARRAYS[out.name]:
        shutil.copyfile(source / f"{name}.npz", out / f"{name}.npz")
    (out / "checkpoint").mkdir(exist_ok=True)
    for item in sorted((source / "checkpoint").iterdir()):
        if item.name in WEIGHT_FILES:
            pack_weights(item, out / "checkpoint")
        else:
            shutil.copyfile(item, out / "checkpoint" / item.name)


def expand(compact: Path, target: Path) -> Path:
    """The compact set `compact` -> `target`, laid out like the original set: checkpoint/ + the arrays."""
    (target / "checkpoint").mkdir(parents=True)
    for item in sorted(compact.iterdir()):
        if item.suffix == ".npz":
            shutil.copyfile(item, target / item.name)
    for item in sorted((compact / "checkpoint").iterdir()):
        if item.name not in ("weights.json", "weights.npz"):
            shutil.copyfile(item, target / "checkpoint" / item.name)
    expand_weights(compact / "checkpoint", target / "checkpoint")
    return target


if __name__ == "__main__":
    command, first, second = sys.argv[1:4]
    {"pack": pack, "expand": expand}[command](Path(first), Path(second))
