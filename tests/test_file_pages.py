"""The pages of a safetensors file's mapping that a source's reads touch: dropped with
``madvise(MADV_DONTNEED)`` after each run of rows where the mapping can be told, by unmapping
after a budget elsewhere; the data read stays that of ``safetensors.torch.load_file``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps and /proc/self/status"
)


def _rss_file() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture()
def big(tmp_path: Path) -> Path:
    """Four 16 MiB tensors, each row full of its index."""
    from safetensors.torch import save_file

    file = tmp_path / "big.safetensors"
    rows = torch.arange(4096, dtype=torch.float32)[:, None].expand(4096, 1024)
    save_file({f"w{i}": rows + 10_000 * i for i in range(4)}, str(file))
    return file


def test_a_read_larger_than_a_run_maps_about_one_run(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One read of 16 MiB of rows (a large unit's local rows) is copied in runs of 1 MiB here,
    the mapped pages dropped after each: measured just before each drop."""
    from safetensors.torch import load_file

    import fsdp_builder.sources.hf_safetensors as hf

    libc = hf._madvise()
    if libc is None:
        pytest.skip("no libc madvise")
    monkeypatch.setattr(hf, "_RUN_BYTES", 1 << 20)
    seen: list[int] = []

    def madvise(address: int, length: int, advice: int) -> int:
        seen.append(_rss_file() - before)
        return int(libc(address, length, advice))

    monkeypatch.setattr(hf, "_madvise", lambda: madvise)
    expected = load_file(str(big))
    for _ in range(2):  # the first pass pages in the code a read runs
        source = hf.open_file(big)
        seen.clear()
        before = _rss_file()
        try:
            got = {key: source.read(key) for key in expected}
        finally:
            source.close()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert len(seen) >= 4 * 16, "a 16 MiB read is copied in runs of at most 1 MiB"
    assert max(seen) < 4 << 20, f"{max(seen) / 2**20:.1f} MiB of the file mapped at once"


def test_the_drop_only_ever_names_the_files_own_mapping(big: Path) -> None:
    """The range found for a file is that of its own file-backed mapping, never an anonymous
    one: an address in a tensor of the process's own memory has no mapping of the file."""
    import fsdp_builder.sources.hf_safetensors as hf

    source = hf.open_file(big)
    try:
        file = source._files[0]
        part = file.part("w1", (slice(8, 16),))
        span = file.mapped(part)
        if span is None:
            pytest.skip("the mapping cannot be told here")
        assert span[0] <= part.data_ptr() < span[1]
        entries = [
            line.split(maxsplit=5)
            for line in Path("/proc/self/maps").read_text().splitlines()
            if int(line.split("-")[0], 16) < span[1]
            and int(line.split()[0].split("-")[1], 16) > span[0]
        ]
        assert entries and all(len(e) == 6 and e[4] != "0" for e in entries), entries
        own = torch.ones(1 << 20)
        assert hf._file_mapping(big, own.data_ptr()) is None
        assert file.mapped(own) is None
    finally:
        source.close()


def test_without_the_mapping_the_budgeted_unmap_reads_the_same(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the mapping cannot be told (no /proc, no libc madvise, a path listed otherwise),
    the source unmaps after its budget, as before."""
    from safetensors.torch import load_file

    import fsdp_builder.sources.hf_safetensors as hf

    monkeypatch.setattr(hf, "_file_mapping", lambda path, address: None)
    monkeypatch.setattr(hf, "_MAPPED_BYTES", 1 << 20)
    expected = load_file(str(big))
    source = hf.open_file(big)
    try:
        out = torch.empty(4096, 1024)
        for key in expected:
            for first in range(0, 4096, 512):
                source.read_into(key, (slice(first, first + 512),), out[first : first + 512])
            assert torch.equal(out, expected[key])
            assert source._files[0].span is None
    finally:
        source.close()


def test_threads_reading_one_source_read_the_file(big: Path) -> None:
    """Several threads reading rows of one source at once: each drop may take pages another
    thread is copying from, which fault back in from the file."""
    from safetensors.torch import load_file

    import fsdp_builder.sources.hf_safetensors as hf

    expected = load_file(str(big))
    source = hf.open_file(big)
    outs = {key: torch.empty(4096, 1024) for key in expected}
    errors: list[BaseException] = []

    def read(key: str) -> None:
        try:
            for first in range(0, 4096, 256):
                rows = (slice(first, first + 256),)
                source.read_into(key, rows, outs[key][first : first + 256])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(key,)) for key in expected]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        source.close()
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    assert all(torch.equal(outs[key], expected[key]) for key in expected)
