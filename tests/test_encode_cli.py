"""`mmtok encode` command line: where rank, world size and device come from."""

from __future__ import annotations

import pytest

from mmtok.cli import build_parser
from mmtok.launch import resolve_rank
from mmtok.errors import MmtokError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "SLURM_LOCALID",
                      "SLURM_ARRAY_TASK_ID")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_flags_win_over_every_launcher_variable(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("SLURM_PROCID", "1")
    assert resolve_rank(2, 4) == (2, 4)


def test_torchrun_variables_win_over_slurm_ones(clean_env):
    # torchrun inside an srun task: SLURM_PROCID numbers the node's task, RANK the worker
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    assert resolve_rank(None, None) == (5, 8)


def test_srun_variables_alone(clean_env):
    clean_env.setenv("SLURM_PROCID", "6")
    clean_env.setenv("SLURM_NTASKS", "7")
    assert resolve_rank(None, None) == (6, 7)


def test_without_launcher_the_plan_world_size_is_the_default(clean_env):
    assert resolve_rank(None, None, default_world_size=4) == (0, 4)
    assert resolve_rank(3, None, default_world_size=4) == (3, 4)


def test_a_slurm_array_task_needs_its_rank_from_flags(clean_env):
    # every array task is SLURM_PROCID 0 of SLURM_NTASKS 1: each would take itself for the whole job
    clean_env.setenv("SLURM_ARRAY_TASK_ID", "17")
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    with pytest.raises(MmtokError, match=r"SLURM array task 17: .*--rank \"\$SLURM_ARRAY_TASK_ID\" --world-size N"):
        resolve_rank(None, None)
    assert resolve_rank(17, 6400) == (17, 6400)  # the documented flags
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, None) == (2, 4)  # torchrun inside an array task numbers its own workers


def test_a_rank_outside_the_world_is_refused(clean_env):
    with pytest.raises(MmtokError, match="rank 4 is outside 0..3"):
        resolve_rank(4, 4)


def test_the_parser_takes_the_audio_options_too():
    args = build_parser().parse_args(["encode", "--modality", "audio", "--checkpoint", "c", "--out", "o",
                                      "--shar", "s", "--loader-threads", "3"])
    assert args.modality == "audio" and str(args.shar) == "s" and args.loader_threads == 3



@pytest.mark.parametrize("env, expected", [({"LOCAL_RANK": "3"}, 3), ({"SLURM_LOCALID": "5"}, 1), ({}, 0)])
def test_the_cuda_device_is_made_current_before_anything_allocates(monkeypatch, env, expected):
    # pinned buffers and weights create their CUDA context on the *current* device: it must be ours
    import torch

    from mmtok.launch import resolve_device

    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert resolve_device(None) == torch.device("cuda", expected)
    assert made_current == [torch.device("cuda", expected)]
    assert resolve_device("cpu") == torch.device("cpu") and len(made_current) == 1


@pytest.mark.parametrize("env, message", [({"RANK": "abc"}, "RANK='abc' is not an integer"),
                                          ({"WORLD_SIZE": "0"}, "world size 0: it must be at least 1")])
def test_a_bad_launcher_environment_is_one_clear_error(monkeypatch, env, message):
    from mmtok.errors import MmtokError
    from mmtok.launch import resolve_rank

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MmtokError, match=message):
        resolve_rank(None, None)


def test_a_damaged_plan_or_tokenizer_file_is_one_line(tmp_path, capsys):
    from mmtok.cli import main

    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.json").write_text("{")
    assert main(["inspect", str(tmp_path / "plan")]) == 2
    assert "plan.json: damaged" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"')
    assert main(["tokenizer", "build", "--text-tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a text tokenizer this tool can read" in err and "Traceback" not in err
