"""Start ``world_size`` local ranks, run a function on each, and collect what they return.
Every run has a deadline: a rank that hangs is killed and the call raises."""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import IO, Any

import attrs
import torch
import torch.distributed as dist

# Set to a path prefix, the processes of one run (a test run's workers and what they start)
# share the machine's cores: one lock file PREFIX.<n> per core, and PREFIX.gate. A process doing
# its own work holds a core (``own_cores``); a launch holds min(ranks, cores) while its ranks
# run, and hands back its process's own cores meanwhile (that process only waits for its
# ranks). Cores are taken only behind the gate, one taker at a time: none waits for a taker,
# and a launch waiting for its cores gets the next that comes free.
RANK_SLOTS = "FSDP_BUILDER_RANK_SLOTS"

# A launch waiting longer than this for its cores starts with those it holds: a core held by a
# process that waits for this launch (one that started it as a subprocess while holding a core)
# would otherwise never come free.
SLOT_WAIT_SECONDS = 120.0


@attrs.define
class _Cores:
    """The cores this process holds for its own work (``own_cores``), and of which slots."""

    own: list[IO[str]] = attrs.Factory(list)
    prefix: str = ""


_CORES = _Cores()


def _slot_prefix() -> str | None:
    prefix = os.environ.get(RANK_SLOTS)
    return prefix if prefix and sys.platform.startswith("linux") else None


def _try_lock(path: str) -> IO[str] | None:
    """``path``'s lock, on a file of its own (closing it releases the lock); None when another
    file holds it."""
    import fcntl

    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _take(prefix: str, count: int, wait: float | None = None) -> list[IO[str]]:
    """The locks of ``count`` cores (at most every core), behind the gate; past ``wait``
    seconds (None: no limit) those held so far."""
    import fcntl

    cores = os.cpu_count() or 1
    want = min(count, cores)
    held: dict[int, IO[str]] = {}
    deadline = None if wait is None else time.monotonic() + wait
    with open(f"{prefix}.gate", "a") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        while len(held) < want:
            for slot in range(cores):
                if slot not in held and len(held) < want:
                    if (f := _try_lock(f"{prefix}.{slot}")) is not None:
                        held[slot] = f
            if len(held) == want or (deadline is not None and time.monotonic() > deadline):
                break
            # Polled, not blocked on one core: any core may come free first, and a wait with
            # a limit must be able to end.
            time.sleep(0.005)
    return list(held.values())


@contextlib.contextmanager
def own_cores(count: int = 1) -> Iterator[int]:
    """Hold ``count`` of the cores named by ``$FSDP_BUILDER_RANK_SLOTS`` for this process's own
    work (a test running in it, and what it starts that does not take cores itself), waiting
    for them; yields how many are held: 0 when the variable is unset, the platform has no
    ``flock``, or this process holds its own already. A launch from this process hands them back
    while its ranks run."""
    prefix = _slot_prefix()
    if prefix is None or _CORES.own:
        yield 0
        return
    _CORES.own, _CORES.prefix = _take(prefix, count), prefix
    try:
        yield len(_CORES.own)
    finally:
        own, _CORES.own = _CORES.own, []
        for f in own:
            f.close()


@contextlib.contextmanager
def rank_slots(world_size: int) -> Iterator[int]:
    """Hold this launch's share of the cores named by ``$FSDP_BUILDER_RANK_SLOTS`` while its
    ranks run, this process's own cores handed back meanwhile; yields how many are held: 0 when
    the variable is unset or the platform has no ``flock``, fewer than asked after
    ``SLOT_WAIT_SECONDS``."""
    prefix = _slot_prefix()
    if prefix is None:
        yield 0
        return
    own: list[IO[str]] = []
    if _CORES.prefix == prefix:
        own, _CORES.own = _CORES.own, []
    for f in own:
        f.close()
    held: list[IO[str]] = []
    try:
        held = _take(prefix, world_size, wait=SLOT_WAIT_SECONDS)
        yield len(held)
    finally:
        for f in held:
            f.close()
        if own:
            _CORES.own = _take(prefix, len(own))


class RankFailure(RuntimeError):
    """A rank raised, died or missed the deadline; the message holds every rank's story."""


def end_process_group() -> None:
    """Destroy the default process group and free what still holds its backend.

    Precondition: the caller holds no sharded model. torch's gloo backend frees a finished
    collective on its own thread, and that needs the GIL; one still pending when the interpreter
    shuts down aborts the process ("terminate called without an active exception"). FSDP modules
    hold their groups in reference cycles, so collecting them here frees the groups while Python
    still runs, and a group's destructor joins those threads.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    # The launch holds the slots: a rank's own launches must not wait for them.
    os.environ.pop(RANK_SLOTS, None)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    limit = timedelta(seconds=timeout)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=limit)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=limit
        )
        # torch.save keeps tensors self-contained; the queue's default would share storage with
        # a process that is about to exit.
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        end_process_group()


def _missing_story(rank: int, code: int | None, died: list[int], timeout: float) -> str:
    """Why ``rank`` returned nothing: it exited, or ran past the deadline or others' deaths."""
    if code is not None:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return (
            f"rank {rank} {how} before reporting a result (it crashed, was killed, or failed "
            "while starting: its own output above says why)"
        )
    if died:
        others = ", ".join(str(r) for r in died if r != rank)
        return f"rank {rank} was still running after rank(s) {others} died, and was killed"
    return f"rank {rank} did not finish within {timeout:.0f}s and was killed"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    start_method: str = "spawn",
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(*args)`` (importable, module level) on ``world_size`` new ranks with a process
    group; return the per-rank results. ``grace``: seconds the others get once a rank died
    without reporting. With ``$FSDP_BUILDER_RANK_SLOTS`` set, the ranks start once this launch
    holds its cores (``rank_slots``), and the deadline counts from then. Raises RankFailure
    naming every rank's story."""
    with rank_slots(world_size):
        return _run_ranks(fn, world_size, args, timeout, backend, start_method, grace)


def _run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    backend: str,
    start_method: str,
    grace: float,
) -> list[Any]:
    ctx: Any = mp.get_context(start_method)  # every context has Process and Queue
    results = ctx.Queue()
    limit = timedelta(seconds=timeout)
    # The parent keeps the store's OS-chosen port bound, so no other process can take it.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=limit
    )
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, backend, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[bool, Any]] = {}
    died: list[int] = []  # ranks that exited without reporting, in the order they were found
    while len(got) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            got[rank] = (ok, payload)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
            if dead and all(procs[i].exitcode not in (None, 0) for i in dead):
                # A rank died without reporting: the rest cannot finish.
                died = dead
                break
    for p in procs:
        p.join(timeout=max(0.0, min(grace, deadline - time.monotonic())))
    # Read before the stragglers are killed: how each rank that did not report ended.
    codes = {i: p.exitcode for i, p in enumerate(procs)}
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    missing = [r for r in range(world_size) if r not in got]
    failed = {r: payload for r, (ok, payload) in got.items() if not ok}
    if missing or failed:
        parts = [_missing_story(r, codes[r], died, timeout) for r in missing]
        parts += [f"rank {r} raised:\n{tb}" for r, tb in sorted(failed.items())]
        raise RankFailure("\n".join(parts))
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
