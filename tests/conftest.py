import os
import sys
from pathlib import Path

# Keep CPU tests quiet and reproducible on small machines.
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import multiprocessing
import time

import pytest

_CHECKED: set[Path] = set()


def pytest_configure(config):
    config.addinivalue_line("markers", "damages_datasets: the test corrupts .idx/.bin files on purpose; the "
                            "megatron-core open check after it is skipped")


@pytest.fixture(scope="session")
def golden_sets(tmp_path_factory):
    """name -> that golden codec set's folder (realmedia.golden), expanded at most once per session."""
    from realmedia import golden

    cache = tmp_path_factory.mktemp("golden")
    return lambda name: golden(name, cache)


@pytest.fixture(scope="module")
def forkserver():
    """Encode processes forked from a server that has torch and mmtok imported: a restart costs
    milliseconds instead of seconds of imports, so many kills fit in a fast test."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the server: the CPU "device" shares 2 cores with loaders
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo (imported by a codec load on the meta device) and pyarrow.dataset (filtered plan
    # reads) take seconds to import: do it once, in the server
    context.set_forkserver_preload(["torch", "torch._dynamo", "pyarrow.dataset", "mmtok.cli", "mmtok.encode.runner",
                                    "mmtok.codecs.emu35"])
    yield context
    if previous is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = previous


@pytest.fixture(autouse=True)
def every_written_dataset_opens_in_megatron_core(request, tmp_path_factory):
    """After each test, every `.idx` written under pytest's temporary root since the test started must
    open with megatron-core's IndexedDataset (mmtok writes no dataset Megatron cannot load)."""
    started = time.time() - 1
    yield
    root = tmp_path_factory.getbasetemp()
    fresh = [p for p in root.rglob("*.idx") if p not in _CHECKED and p.stat().st_mtime >= started]
    _CHECKED.update(fresh)  # each file is judged once, after the test that wrote it
    if not fresh or request.node.get_closest_marker("damages_datasets"):
        return
    from mmtok.formats.megatron import import_indexed_dataset, release_reader

    IndexedDataset = import_indexed_dataset()
    for idx in fresh:
        prefix = str(idx)[: -len(".idx")]
        try:
            dataset = IndexedDataset(prefix)
            assert len(dataset) == len(dataset.sequence_lengths)
            release_reader(dataset)
            del dataset
        except Exception as err:  # noqa: BLE001 - report any reader failure as the test's failure
            pytest.fail(f"{idx} does not open in megatron-core's IndexedDataset: {type(err).__name__}: {err}")


@pytest.fixture
def mount(tmp_path):
    """make(size) -> a tmpfs of `size` bytes under tmp_path (`diskkit.Mount`), unmounted after the test."""
    from diskkit import Mount

    mounts = []

    def make(size: int) -> Mount:
        mounts.append(Mount(tmp_path / f"fs{len(mounts)}", size))
        return mounts[-1]

    yield make
    for m in mounts:
        m.umount()


@pytest.fixture(scope="session")
def caption_blend(tmp_path_factory):
    """Two merged outputs of the real flow on the caption corpus (modes image-text and text-image: 22 documents,
    763 tokens each) and their `mmtok tokenizer build` directory, for the tests that train on them with
    megatron-core (`root`, `env`, `datasets`: the two prefixes, `tokenizer`). Made once: the build takes seconds."""
    from types import SimpleNamespace

    from encodekit import caption_env, encode_all, one_torch_thread, plan
    from mmtok.cli import main

    root = tmp_path_factory.mktemp("caption-blend")
    with one_torch_thread():
        env = caption_env(root)
        outs = [encode_all(env, plan(env, f"plan-{mode}", "--mode", mode), root / mode, world_size=1)
                for mode in ("image-text", "text-image")]
    assert main(["tokenizer", "build", "--text-tokenizer", str(env.text), "--out", str(root / "omni")]) == 0
    return SimpleNamespace(root=root, env=env, datasets=[out / "merged" for out in outs], tokenizer=root / "omni")
