"""Many multi-rank scenarios in one spawn, each with its own result.

Starting ranks is the expensive part of a multi-rank test on a small machine, so one spawn per
world size runs every scenario of a test module. Inside the ranks, :func:`run_each` runs each
scenario on its own and keeps either its value or its formatted error; in the test process,
:func:`values` hands one scenario's per-rank values to the test that checks it, or fails that
test with the scenario's own error. One broken scenario then fails only the tests that read it.

After each scenario the ranks report to each other through the launcher's rendezvous store. When
every rank reports, every collective of the scenario was matched and the next scenario runs,
whichever ranks failed. When a rank fails where its peers go on to a collective, those peers
wait for it: after ``stall_seconds`` the ranks that did report tear down their process groups,
which ends the peers' wait with an error. The scenario then has each rank's own error, and the
later scenarios report that they did not run and why, instead of the whole spawn running into
its deadline. (Tearing down ends a wait on gloo; an NCCL wait may only end at the deadline.)
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from fsdp_builder.tools.launch import run_ranks


@dataclass(frozen=True)
class Outcome:
    """One scenario on one rank: its value, or the formatted error it raised."""

    value: Any = None
    error: str | None = None


Results = dict[Hashable, Outcome]


def _status_store(timeout: float) -> dist.Store | None:
    """A client of the rendezvous store that ``run_ranks`` (or torchrun) hosts."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if dist.get_world_size() == 1 or not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore("isolated-scenarios", store)


def _report(store: dist.Store, step: int, failed: bool, stall_seconds: float) -> str | None:
    """Tell the other ranks how scenario ``step`` went; None when the ranks are in step,
    otherwise why the later scenarios cannot run (the same words on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{step}/{rank}", "failed" if failed else "ok")
    keys = [f"{step}/{r}" for r in range(world)]
    declared = f"{step}/declared"
    deadline = time.monotonic() + stall_seconds
    pause = 0.001
    # Polled rather than waited on: a rank that another rank's declaration (below) freed from a
    # collective must see the declaration at once, not after its own stall_seconds.
    while not store.check(keys) and not store.check([declared]):
        if time.monotonic() >= deadline:
            # Some ranks are still inside the scenario: waiting in a collective of the ranks
            # that left it. The first rank to see it says so, once, for everyone.
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing and store.add(declared, 1) == 1:
                failed_ranks = [
                    r for r, k in enumerate(keys) if r not in missing and _failed(store, k)
                ]
                store.set(
                    f"{step}/stalled",
                    f"rank(s) {_ranks(missing)} stalled in it after rank(s) "
                    f"{_ranks(failed_ranks)} failed it, so the process groups were torn down",
                )
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    if not store.check([f"{step}/declared"]):
        return None
    store.wait([f"{step}/stalled"])
    # Tearing down ends the waits of the stalled ranks, which then come here too.
    dist.destroy_process_group()
    return store.get(f"{step}/stalled").decode()


def _failed(store: dist.Store, key: str) -> bool:
    return store.get(key) == b"failed"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"


def run_each(
    cases: Iterable[tuple[Hashable, Callable[[], Any]]], stall_seconds: float = 60.0
) -> Results:
    """Run each ``(key, scenario)`` of ``cases`` (in order, on every rank) and keep its outcome.

    ``cases`` may be a generator: a key is only needed when its scenario is about to run.
    """
    store = _status_store(stall_seconds)
    results: Results = {}
    stopped: str | None = None
    for step, (key, scenario) in enumerate(cases):
        if stopped is not None:
            results[key] = Outcome(error=f"not run: after scenario {stopped}")
            continue
        try:
            results[key] = Outcome(value=scenario())
        except Exception:
            results[key] = Outcome(error=traceback.format_exc())
        if store is not None:
            why = _report(store, step, results[key].error is not None, stall_seconds)
            if why is not None:
                stopped = f"{key!r}: {why}"
    return results


# Ranks fork from a server that imported these once (conftest sets it up before the first
# spawn), instead of each rank importing torch and transformers again: most of a small spawn's
# time on a 2-core machine. Each rank is still a fresh process of its own.
START_METHOD = "forkserver"
PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "fsdp_builder",
    "fsdp_builder.tools.launch",
    "isolated",
    "models",
]


class Spawns:
    """One spawn per world size, run when a test first asks for it; a spawn that fails as a
    whole (a rank died, the deadline passed) fails every test that reads it, without a rerun."""

    def __init__(self, fn: Callable[..., Results], timeout: float = 240.0, **kwargs: Any) -> None:
        self.fn = fn
        self.timeout = timeout
        self.kwargs = {"start_method": START_METHOD, **kwargs}
        self._runs: dict[int, list[Results] | BaseException] = {}

    def __call__(self, world: int, *args: Any) -> list[Results]:
        if world not in self._runs:
            try:
                self._runs[world] = run_ranks(
                    self.fn, world, *args, timeout=self.timeout, **self.kwargs
                )
            except Exception as exc:
                self._runs[world] = exc
        run = self._runs[world]
        if isinstance(run, BaseException):
            pytest.fail(f"the spawn of {world} rank(s) failed as a whole:\n{run}", pytrace=False)
        return run


def values(ranks: list[Results], key: Hashable) -> list[Any]:
    """Scenario ``key``'s value on every rank; fails the calling test with the scenario's error
    (once per distinct message, naming its ranks) if it failed or did not run on any rank."""
    missing = [r for r, results in enumerate(ranks) if key not in results]
    if missing:
        pytest.fail(f"scenario {key!r} is not among the results of rank(s) {missing}")
    errors: dict[str, list[int]] = {}
    for rank, results in enumerate(ranks):
        error = results[key].error
        if error is not None:
            errors.setdefault(error, []).append(rank)
    if errors:
        parts = [f"rank(s) {', '.join(map(str, rs))}:\n{text}" for text, rs in errors.items()]
        pytest.fail(f"scenario {key!r} failed\n" + "\n".join(parts), pytrace=False)
    return [results[key].value for results in ranks]
