import json

import numpy as np
import pytest

from mmtok.vocab import OMNI_SPECIAL_TOKENS, VocabLayout

APERTUS_IDS = {
    "<|omni_reserved_0|>": 131_072,
    "<|img_start|>": 131_073,
    "<|img_end|>": 131_074,
    "<|img_token_start|>": 131_075,
    "<|img_end_of_row|>": 131_076,
    "<|img_end_of_frame|>": 131_077,
    "<|img_generation_start|>": 131_078,
    "<|image|>": 131_079,
    "<|audio_start|>": 131_080,
    "<|audio_end|>": 131_081,
    "<|stt_transcribe|>": 131_082,
    "<|stt_continue|>": 131_083,
    "<|tts_continue|>": 131_084,
    "<|audio|>": 131_085,
    "<|stt_translate|>": 131_086,
    "<|audio_annotate|>": 131_087,
}


def test_apertus_special_ids_are_pinned():
    layout = VocabLayout()
    assert layout.special_ids() == APERTUS_IDS
    assert layout.special_id("<image>") == 131_079
    assert layout.special_id("<audio>") == 131_085


def test_apertus_block_boundaries_are_pinned():
    layout = VocabLayout()
    assert layout.image_offset == 131_272
    assert int(layout.image_ids(np.array([0, 131_071]))[-1]) == 262_343
    assert layout.audio_offset == 262_344
    assert int(layout.audio_ids(np.array([4_095]))[0]) == 266_439
    assert layout.total_size == 266_440


def test_eurollm_base_shifts_every_block_by_the_same_amount():
    apertus, eurollm = VocabLayout(131_072), VocabLayout(128_000)
    shift = 131_072 - 128_000
    for name, value in apertus.special_ids().items():
        assert eurollm.special_id(name) == value - shift
    assert eurollm.image_offset == apertus.image_offset - shift
    assert eurollm.audio_offset == apertus.audio_offset - shift
    assert eurollm.total_size == apertus.total_size - shift


def test_codes_outside_the_codebook_are_refused():
    layout = VocabLayout()
    with pytest.raises(ValueError):
        layout.image_ids(np.array([131_072]))
    with pytest.raises(ValueError):
        layout.audio_ids(np.array([-1]))


def test_image_block_structure_and_length():
    layout = VocabLayout()
    codes = np.arange(6).reshape(2, 3)
    dims = [9, 8, 7]
    block = layout.image_block(codes, dims)
    assert block.dtype == np.int32
    expected = [131_073, 9, 8, 7, 131_075,
                131_272, 131_273, 131_274, 131_076,
                131_275, 131_276, 131_277, 131_076,
                131_077, 131_074]
    assert block.tolist() == expected
    assert VocabLayout.image_block_length(2, 3, len(dims)) == len(expected)


def test_audio_block_structure():
    layout = VocabLayout()
    assert layout.audio_block(np.array([0, 5])).tolist() == [131_080, 262_344, 262_349, 131_081]


def test_omnimodal_config_export_matches_the_fork_schema():
    config = VocabLayout().omnimodal_config()
    assert json.loads(json.dumps(config)) == {
        "base_vocab_size": 131_072,
        "omnimodal_config": {
            "omni_special_token_offset": 131_072,
            "modalities": [
                {"name": "vision", "offset": 131_272, "vocab_size": 131_072},
                {"name": "audio", "offset": 262_344, "vocab_size": 4_096},
            ],
        },
    }
    assert len(OMNI_SPECIAL_TOKENS) == 16


def test_split_sequence_recovers_every_block():
    layout = VocabLayout()
    image_codes = np.arange(12).reshape(3, 4) * 1000
    audio_codes = np.array([0, 7, 4095])
    tokens = np.concatenate([[1, 50], layout.image_block(image_codes, [11, 12]), [60],
                             layout.audio_block(audio_codes), [2]])
    segments = layout.split_sequence(tokens)
    kinds = [segment[0] for segment in segments]
    assert kinds == ["text", "image", "text", "audio", "text"]
    assert segments[0][1].tolist() == [1, 50]
    assert np.array_equal(segments[1][1], image_codes)
    assert segments[1][2].tolist() == [11, 12]
    assert np.array_equal(segments[3][1], audio_codes)
    assert segments[4][1].tolist() == [2]


def test_split_sequence_rejects_ragged_image_rows():
    layout = VocabLayout()
    block = layout.image_block(np.zeros((2, 3), np.int64), [5]).tolist()
    del block[4]  # drop the first code of row 0
    with pytest.raises(ValueError, match="ragged"):
        layout.split_sequence(np.array(block))
