"""Where this process's rank, world size and device come from: flags, then the launcher's environment.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK per worker (also when it runs inside an srun task), srun
sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID. Used by every command that runs a codec; imports no stage.
"""

from __future__ import annotations

import os
import re
import signal
import threading

from mmtok.errors import MmtokError, brief

# The exit status of a worker that stopped on request with its work committed (EX_TEMPFAIL, sysexits.h): the
# printed sbatch script requeues its array task on it (`mmtok.commands.encode.sbatch_script`).
STOPPED_EXIT = 75
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
DEVICE_FORMS = "cpu, cuda, cuda:N (N = 0, 1, ...: a GPU index) or mps"
_DEVICE = re.compile(r"cpu|mps|cuda(:[0-9]+)?")


def resolve_rank(rank: int | None, world_size: int | None, default_world_size: int = 1) -> tuple[int, int]:
    """Flags first, then RANK/WORLD_SIZE (torchrun sets them per worker, also inside an srun task),
    then SLURM_PROCID/SLURM_NTASKS, then (0, default_world_size). Inside a SLURM array task the SLURM
    variables are refused: there every task is SLURM_PROCID 0 of SLURM_NTASKS 1, so each would take itself for
    the whole job (the first encodes everything, the lock refuses the rest)."""
    if (rank is None or world_size is None) and "SLURM_ARRAY_TASK_ID" in os.environ \
            and not {"RANK", "WORLD_SIZE"} & set(os.environ):
        raise MmtokError(f"this is SLURM array task {os.environ['SLURM_ARRAY_TASK_ID']}: its SLURM_PROCID/SLURM_NTASKS "
                         "say rank 0 of 1 in every task; pass --rank \"$SLURM_ARRAY_TASK_ID\" --world-size N (the "
                         "array's size, e.g. --array=0-6399%800 -> 6400), or --rank 0 --world-size 1 for one process "
                         "that does the whole job (a final assembly scan)")
    rank_from = world_from = None
    if rank is None:
        rank, rank_from = _env_int(("RANK", "SLURM_PROCID"), 0)
    if world_size is None:
        world_size, world_from = _env_int(("WORLD_SIZE", "SLURM_NTASKS"), default_world_size)
    if world_size < 1:
        raise MmtokError(f"world size {world_size}{_source(world_from)}: it must be at least 1")
    if not 0 <= rank < world_size:
        raise MmtokError(f"rank {rank}{_source(rank_from)} is outside 0..{world_size - 1} (world size "
                         f"{world_size}{_source(world_from)})")
    return rank, world_size


def _env_int(names: tuple[str, ...], default: int, flags: str = "--rank/--world-size") -> tuple[int, str | None]:
    """The first of `names` set in the environment, as an integer, and its name (else `default`, None)."""
    for name in names:
        if name in os.environ:
            try:
                return int(os.environ[name]), name
            except ValueError:
                raise MmtokError(f"{name}={brief(repr(os.environ[name]), 60)} is not an integer; fix the launcher "
                                 f"environment or pass {flags}") from None
    return default, None


def _source(name: str | None) -> str:
    """Where a value came from, for messages: ' (from NAME=value)', or '' for a flag or a default."""
    return "" if name is None else f" (from {name}={brief(os.environ[name], 40)})"


def _local_rank(name: str) -> int | None:
    """The GPU index a launcher variable names: None when it is unset or -1 (what some launchers export for
    "not distributed": the next rule picks the device), MmtokError naming it for any other negative value."""
    if name not in os.environ:
        return None
    value, _ = _env_int((name,), 0, "--device")
    if value == -1:
        return None
    if value < 0:
        raise MmtokError(f"{name}={value}: a local rank is 0 or more (-1 means not distributed); fix the launcher "
                         "environment or pass --device")
    return value


def resolve_device(requested: str | None = None):
    """--device, else cuda:LOCAL_RANK, else cuda:(SLURM_LOCALID mod visible GPUs) under srun, else cuda:0,
    else cpu. A CUDA device is made this process's current device at once (`torch.cuda.set_device`),
    before anything allocates on CUDA: pinned host buffers and the codec's weights then create their
    context on this GPU, not a stray one on cuda:0 (one per process on a multi-GPU node)."""
    import torch

    source = ""  # where the index came from, when a launcher variable named it
    if requested:
        device = torch.device(parse_device(requested))
    elif not torch.cuda.is_available():
        device = torch.device("cpu")
    elif (local := _local_rank("LOCAL_RANK")) is not None:
        device, source = torch.device("cuda", local), _source("LOCAL_RANK")
    elif (local := _local_rank("SLURM_LOCALID")) is not None:
        device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    else:
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        _check_visible(device, source)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def parse_device(text: str) -> str:
    """`text` when it names a device (DEVICE_FORMS), else MmtokError saying what is accepted: checked where
    the flag is parsed, before any work, so `--device gpu0` never reaches torch (whose message lists a dozen
    device types mmtok does not run on)."""
    if not _DEVICE.fullmatch(text.strip()):
        raise MmtokError(f"--device {brief(repr(text), 60)} is not a device: pass {DEVICE_FORMS}")
    return text.strip()


def _check_visible(device, source: str = "") -> None:
    """A CUDA device this process can see (CUDA_VISIBLE_DEVICES renumbers them from 0)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise MmtokError(f"device {device}{source}: this process sees no CUDA device; pass --device cpu, or run where "
                         "a GPU is")
    if device.index is not None and device.index >= count:
        raise MmtokError(f"device {device}{source}: this process sees {count} CUDA device(s), "
                         f"cuda:0 … cuda:{count - 1}")


class StopRequest:
    """SIGUSR1 (SLURM's `--signal=B:USR1@120` before the time limit, forwarded by the sbatch script) and SIGTERM
    (preemption, scancel) ask a worker to stop *cleanly*: it commits the batch in flight, closes its part without
    finishing it (the lock goes with the process) and exits STOPPED_EXIT; the next run resumes the part from that
    commit. Without this, the default action kills the process mid-batch, which is safe (the commit log cuts the
    torn batch) but loses the batches in flight and leaves the tail of the time limit unused.

    A context manager: installs the handlers in the main thread on entry, restores the previous ones on exit.
    `is_set()` is what the device loop checks before it takes the next batch; `name` says which signal came."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, in_flight: str = "the batch in flight"):
        """`in_flight`: what the worker commits before it stops, for the notice (`mmtok sft`: its unit)."""
        self.signals = signals
        self.in_flight = in_flight
        self.event = threading.Event()
        self.name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, _frame) -> None:
        first = not self.event.is_set()
        self.name = self.name or signal.Signals(number).name
        self.event.set()
        if first:  # os.write: print() is not safe inside a signal handler (it may interrupt another print)
            os.write(2, f"mmtok: {signal.Signals(number).name} received: committing {self.in_flight}, then "
                        "stopping (a rerun resumes from that commit)\n".encode())

    def is_set(self) -> bool:
        return self.event.is_set()


def stop_check(stop: "StopRequest | None"):
    """What a worker asks before each batch, unit or item: whether `stop` (None: never) was requested."""
    return lambda: stop is not None and stop.is_set()
