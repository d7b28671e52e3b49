"""`mmtok encode` command line: where rank, world size and device come from."""

from __future__ import annotations

import re

import pytest

from mmtok.cli import build_parser
from mmtok.errors import MmtokError
from mmtok.launch import resolve_rank

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
                                          ({"WORLD_SIZE": "0"}, r"world size 0 \(from WORLD_SIZE=0\): it must be"),
                                          ({"SLURM_NTASKS": "-3"}, r"world size -3 \(from SLURM_NTASKS=-3\)"),
                                          ({"RANK": "-1", "WORLD_SIZE": "4"},
                                           r"rank -1 \(from RANK=-1\) is outside 0..3"),
                                          ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2"},
                                           r"rank 5 \(from SLURM_PROCID=5\) is outside 0..1 \(world size 2 \(from "
                                           r"SLURM_NTASKS=2\)\)")])
def test_a_bad_launcher_environment_is_one_clear_error(clean_env, env, message):
    from mmtok.errors import MmtokError
    from mmtok.launch import resolve_rank

    monkeypatch = clean_env
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


def _cuda_mocked(monkeypatch, count: int = 4) -> list:
    import torch

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "-1"}, {"SLURM_LOCALID": "-1"},
                                 {"LOCAL_RANK": "-1", "SLURM_LOCALID": "2"}])
def test_a_local_rank_of_minus_one_means_not_distributed(clean_env, env):
    """-1 is what some launchers export for "not distributed": the next rule picks the device."""
    import torch

    from mmtok.launch import resolve_device

    for name, value in env.items():
        clean_env.setenv(name, value)
    made_current = _cuda_mocked(clean_env)
    expected = torch.device("cuda", int(env.get("SLURM_LOCALID", "0")) if env.get("SLURM_LOCALID") != "-1" else 0)
    assert resolve_device(None) == expected and made_current == [expected]


@pytest.mark.parametrize("env, message", [({"LOCAL_RANK": "-7"}, "LOCAL_RANK=-7: a local rank is 0 or more"),
                                          ({"SLURM_LOCALID": "-2"}, "SLURM_LOCALID=-2: a local rank is 0 or more"),
                                          ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer.*pass --device"),
                                          ({"LOCAL_RANK": "9"},
                                           r"device cuda:9 \(from LOCAL_RANK=9\): this process sees 4")])
def test_a_local_rank_out_of_range_is_one_line_through_the_cli(clean_env, tmp_path, capsys, env, message):
    """On a CUDA machine (mocked) a bad LOCAL_RANK or SLURM_LOCALID ended in a traceback from torch.device."""
    from mmtok.cli import main
    from mmtok.codecs import emu35

    for name, value in env.items():
        clean_env.setenv(name, value)
    checkpoint = emu35.write_random_checkpoint(tmp_path / "ckpt")
    _cuda_mocked(clean_env)
    assert main(["codec", "encode", "--codec", "emu3.5", "--checkpoint", str(checkpoint), str(tmp_path / "x.png"),
                 "--out", str(tmp_path / "codes.npy")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert re.search(message, line), line


def test_a_rank_out_of_range_is_one_line_before_any_work(clean_env, tmp_path, capsys):
    from mmtok.cli import main

    clean_env.setenv("RANK", "-1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert main(["encode", "--modality", "audio", "--shar", str(tmp_path / "shar"), "--checkpoint",
                 str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "rank -1 (from RANK=-1) is outside 0..1" in line, line


# -- issue 48.4: an --out that holds another run's parts is refused at start-up --------------------------
@pytest.fixture(scope="module")
def one_part(tmp_path_factory):
    """Rank 0 of 2 encoded into OUT (caption corpus, tiny codec, small work items): (env, plan, out)."""
    from encodekit import caption_env, one_torch_thread, plan
    from mmtok.cli import main

    env = caption_env(tmp_path_factory.mktemp("run"))
    planned = plan(env, "plan", "--world-size", "2", "--item-seconds", "0.0005")
    out = env.root / "out"
    with one_torch_thread():
        assert main(["encode", "--plan", str(planned), "--checkpoint", str(env.checkpoint), "--out", str(out),
                     "--rank", "0", "--world-size", "2", "--device", "cpu", "--no-progress"]) == 0
    return env, planned, out


@pytest.mark.parametrize("change, message", [
    ("plan", "plan_fingerprint (recorded"),
    ("codec", "codec.checkpoint_sha256 (recorded"),  # the first key that differs; codec.name too
    ("checkpoint", "codec.checkpoint_sha256 (recorded"),
])
def test_a_rank_of_another_run_is_refused_before_its_codec_loads(one_part, clean_env, capsys, change, message):
    from encodekit import plan
    from mmtok.cli import main
    from mmtok.codecs import emu3, emu35, registry

    env, planned, out = one_part
    checkpoint, codec, world = env.checkpoint, "emu3.5", "2"
    if change == "plan":
        planned = plan(env, "plan-other", "--world-size", "2", "--item-seconds", "0.0005", "--max-aspect-ratio", "3.99")
    elif change == "codec":
        codec, checkpoint = "emu3", emu3.write_random_checkpoint(env.root / "emu3")
    else:
        checkpoint = emu35.write_random_checkpoint(env.root / "other-ckpt", seed=5)
    clean_env.setattr(registry, "load_codec", lambda *a, **k: pytest.fail("the codec was loaded"))
    capsys.readouterr()
    before = sorted(p.name for p in (out / "parts").iterdir())
    assert main(["encode", "--plan", str(planned), "--codec", codec, "--checkpoint", str(checkpoint),
                 "--out", str(out), "--rank", "1", "--world-size", world, "--device", "cpu", "--no-progress"]) == 2
    *notes, line = capsys.readouterr().err.splitlines()
    assert f"{out} holds part-00000, a part of another run: {message}" in line and not notes, line
    assert sorted(p.name for p in (out / "parts").iterdir()) == before


@pytest.mark.parametrize("ranks, world", [(["1"], "2"), (["1", "2"], "3")])
def test_the_same_run_s_other_ranks_are_encoded_with_any_worker_count(one_part, clean_env, tmp_path, ranks, world):
    """The refusal compares runs, not ranks: rank 1 of the same run encodes beside rank 0 (into a copy), and so do
    ranks 1 and 2 of 3 -- the parts are the plan's work items, whatever the number of workers."""
    import shutil

    from encodekit import one_torch_thread
    from mmtok.cli import main

    env, planned, out = one_part
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    with one_torch_thread():
        for rank in ranks:
            assert main(["encode", "--plan", str(planned), "--checkpoint", str(env.checkpoint), "--out", str(copy),
                         "--rank", rank, "--world-size", world, "--device", "cpu", "--no-progress"]) == 0
    assert main(["merge", str(copy)]) == 0
