"""`mmtok encode` command line: where rank, world size and device come from."""

from __future__ import annotations

import pytest

from mmtok.cli import build_parser
from mmtok.launch import resolve_rank
from mmtok.errors import MmtokError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "SLURM_LOCALID")


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
