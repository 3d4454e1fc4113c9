"""The storage step's pieces that read private torch names or call libc, each with a public
fallback (see docs/private_names.md and benchmarks/results/private_ab.md).

A large fresh CPU tensor faults in one page per trap as it is first written;
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) does it in one call. The builder writes such
storage in full right after, so this commits nothing the build would not.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

# For benchmarks/results/private_ab.md only: "plain_to_empty", "no_madvise" (comma-separated).
AB_SWITCHES = frozenset(os.environ.get("FSDP_BUILDER_AB", "").split(","))


# <sys/mman.h>; the kernel answers EINVAL for an advice it does not know.
MADV_POPULATE_WRITE = 23
# Below this a tensor usually lives in malloc's heap, whose pages are mostly there already,
# and the call would cost more than the faults it saves.
PREFAULT_MIN_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE


@functools.cache
def libc_madvise() -> Any:
    """libc's ``madvise`` (address, length, advice) -> 0 or -1, on Linux; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


@attrs.define
class _Madvise:
    """The process's ``madvise``, looked up once; a probe on a page of its own heap settles
    ``works``, so a kernel without the advice pays one failed call per process, and one tensor
    the kernel refuses (a read-only file mapping, say) does not turn it off for the others."""

    call: Any = None
    works: bool | None = None if sys.platform.startswith("linux") else False

    def populate(self, address: int, length: int) -> None:
        if self.call is None:
            self.call = libc_madvise()
            if self.call is None:
                self.works = False
                return
        if self.works is None:
            probe = ctypes.create_string_buffer(2 * _PAGE)
            page = -(-ctypes.addressof(probe) // _PAGE) * _PAGE
            self.works = self.call(page, _PAGE, MADV_POPULATE_WRITE) == 0
            if not self.works:
                return
        self.call(address, length, MADV_POPULATE_WRITE)


_MADVISE = _Madvise()


def prefault(tensor: torch.Tensor) -> None:
    """Fault in the whole pages of a large CPU ``tensor``'s storage. Precondition: the caller
    writes all of it next."""
    # Size first: most tensors of a small unit stop here, before any storage lookup.
    if tensor.numel() * tensor.element_size() < PREFAULT_MIN_BYTES:
        return
    if "no_madvise" in AB_SWITCHES or _MADVISE.works is False or tensor.device.type != "cpu":
        return
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    end = (start + storage.nbytes()) // _PAGE * _PAGE
    if end > first:
        _MADVISE.populate(first, end - first)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``'s wrapper costs more than a small parameter's
    work); any other tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


# The private FSDP2 names the direct way reads, by the object that holds them: the unit's
# FSDPModule, its state, a parameter group, a parameter record, a sharded parameter. Each is
# probed before use; a torch that lacks any of them takes to_empty (``has_direct_api``).
MODULE_NAMES = ("_get_fsdp_state",)
# One group per module in some torch releases, a list of groups in others.
STATE_NAMES = ("_fsdp_param_groups", "_fsdp_param_group")
GROUP_NAMES = ("fsdp_params",)
RECORD_NAMES = ("sharded_param", "reset_sharded_param", "to_sharded_dtensor")
SHARDED_NAMES = ("_local_tensor",)


def _has(obj: object, names: tuple[str, ...]) -> bool:
    # Not getattr(obj, name, None): a missing name must not read as a present None.
    return all(hasattr(obj, name) for name in names)


def fsdp2_params(root: nn.Module) -> list[Any] | None:
    """The ``FSDPParam``s of the unit ``root`` shards; None when ``root`` is not FSDP2 or this
    torch's FSDP2 names its records otherwise (then ``to_empty`` is the way)."""
    if not _has(root, MODULE_NAMES):
        return None
    state = root._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, STATE_NAMES[0], None)
    if groups is None:
        if not hasattr(state, STATE_NAMES[1]):
            return None
        single = getattr(state, STATE_NAMES[1])
        groups = [] if single is None else [single]
    if not all(_has(group, GROUP_NAMES) for group in groups):
        return None
    return [fsdp_param for group in groups for fsdp_param in group.fsdp_params]


def has_direct_api(params: list[Any]) -> bool:
    """Whether this torch's FSDP2 parameter records have all that ``give_fsdp2_shards`` and
    ``settle_fsdp2_shards`` use."""
    return all(
        _has(record, RECORD_NAMES) and _has(record.sharded_param, SHARDED_NAMES)
        for record in params[:1]
    )


def give_fsdp2_shards(params: list[Any], device: torch.device, specs: dict[Any, Any]) -> int:
    allocated = 0
    with torch.no_grad():
        for fsdp_param in params:
            param = fsdp_param.sharded_param
            meta = param._local_tensor
            if not meta.is_meta:
                continue
            local = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            prefault(local)
            spec = getattr(fsdp_param, "_sharding_spec", None)
            if spec is not None:
                fsdp_param._sharding_spec = specs.setdefault(spec, spec)
            new = fsdp_param.to_sharded_dtensor(local)
            new.requires_grad_(param.requires_grad)
            # What nn.Parameter(dtensor) does, without its detach through DTensor's dispatch.
            new._is_param = True
            if not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=param.requires_grad)
            # As to_empty does: the Parameter object every slot and FSDP2 hold stays the same.
            torch.utils.swap_tensors(param, new)
            fsdp_param.reset_sharded_param()
            allocated += local.numel() * local.element_size()
    return allocated


def settle_fsdp2_shards(unit_root: nn.Module) -> None:
    """Point FSDP2's references at shards given storage module by module, as ``to_empty``'s
    ``_apply`` would, freeing the meta shards now; a non-FSDP2 module is left alone."""
    params = fsdp2_params(unit_root)
    with torch.no_grad():
        for fsdp_param in params or ():
            fsdp_param.reset_sharded_param()
