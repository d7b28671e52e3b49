import numpy as np
import pytest

from mmtok.formats import megatron


def _write(prefix, sequences):
    with megatron.DatasetWriter(prefix) as writer:
        for seq in sequences:
            writer.add(np.asarray(seq))


def test_megatron_core_reads_what_we_write(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sequences = [[1, 131_073, 266_439, 2], [5], [], list(range(1000, 1300))]
    _write(tmp_path / "data", sequences)
    dataset = IndexedDataset(str(tmp_path / "data"))
    assert len(dataset) == len(sequences)
    for i, seq in enumerate(sequences):
        assert dataset[i].tolist() == seq
    assert dataset.document_indices.tolist() == list(range(len(sequences) + 1))
    assert [s.tolist() for s in megatron.read_sequences(tmp_path / "data")] == sequences


def test_index_bytes_equal_megatron_cores_own_writer(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    sequences = [[3, 4, 5], [131_080, 262_344, 131_081], [7]]
    _write(tmp_path / "ours", sequences)
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    for seq in sequences:
        builder.add_document(torch.tensor(seq, dtype=torch.int32), [len(seq)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()


def test_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    writer = megatron.DatasetWriter(tmp_path / "small", dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        writer.add(np.array([131_073]))
    writer.abort()
    assert not (tmp_path / "small.bin").exists()


def test_concatenate_equals_writing_everything_at_once(tmp_path):
    parts = [[[1, 2], [3]], [[7]], [[4, 5, 6]]]
    for i, part in enumerate(parts):
        _write(tmp_path / f"part{i}", part)
    _write(tmp_path / "whole", [seq for part in parts for seq in part])
    megatron.concatenate([tmp_path / f"part{i}" for i in range(3)], tmp_path / "merged")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"whole{suffix}").read_bytes()


@pytest.mark.damages_datasets
def test_truncated_index_is_rejected(tmp_path):
    _write(tmp_path / "data", [[1, 2, 3]])
    data = (tmp_path / "data.idx").read_bytes()
    (tmp_path / "data.idx").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="truncated"):
        megatron.read_index(tmp_path / "data")


def test_a_dataset_without_tokens_is_never_written(tmp_path):
    # megatron-core cannot mmap an empty .bin: the writer leaves such a dataset out (and says so)
    writer = megatron.DatasetWriter(tmp_path / "empty")
    assert writer.close() is False
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="without tokens"):
        megatron.write_index(tmp_path / "empty", np.zeros(3, np.int64))
