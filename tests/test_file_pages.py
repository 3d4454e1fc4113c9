"""How a safetensors source reads, and the pages of the file it keeps mapped. Whole rows of a
dtype stored as torch stores it, into a contiguous tensor of that dtype (a rank's rows of a
checkpoint in the model's dtype), are positional reads of exactly those bytes: nothing is mapped.
Every other read (a converted dtype, a column slice, strided rows, FP8) goes through safetensors'
``get_slice``, copied in runs of rows spanning at most ``_MAPPED_BYTES`` of the file, the file
unmapped after each run (it opens again at the next): about one run is mapped while a rank reads
and none between reads. The data read stays that of ``safetensors.torch.load_file``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_reads

import fsdp_builder.sources.hf_safetensors as hf

needs_proc = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads /proc/self/status and /proc/self/maps"
)

MIB = 1 << 20


def _rss_file() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def _mapped(file: Path) -> bool:
    """Whether any mapping of the process is of ``file``."""
    return str(file.resolve()) in Path("/proc/self/maps").read_text()


@pytest.fixture()
def big(tmp_path: Path) -> Path:
    """Four 16 MiB tensors, each row full of its index."""
    from safetensors.torch import save_file

    file = tmp_path / "big.safetensors"
    rows = torch.arange(4096, dtype=torch.float32)[:, None].expand(4096, 1024)
    save_file({f"w{i}": rows + 10_000 * i for i in range(4)}, str(file))
    return file


def _converted(
    source: hf.SafetensorsSource, key: str, index: tuple[slice, ...] | None = None
) -> torch.Tensor:
    """``key[index]`` read into a float64 tensor: a converting read, through the mapping."""
    meta = source.tensors()[key]
    # The shape of key[index] as torch indexes it, not the source's own arithmetic.
    shape = torch.empty(meta.shape, device="meta")[index or ()].shape
    out = torch.empty(shape, dtype=torch.float64)
    source.read_into(key, index, out)
    return out


class Samples:
    """RssFile just before each unmap, when a run's pages are all still mapped (the most a read
    holds), above the level at the last :meth:`restart`."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.start = _rss_file()

    def restart(self) -> None:
        self.seen.clear()
        self.start = _rss_file()

    def take(self) -> None:
        self.seen.append(_rss_file() - self.start)


@pytest.fixture()
def samples(monkeypatch: pytest.MonkeyPatch) -> Samples:
    """Samples taken at each unmap, which still happens."""
    unmap = hf._File.unmap
    samples = Samples()

    def measured(self: hf._File) -> None:
        samples.take()
        unmap(self)

    monkeypatch.setattr(hf._File, "unmap", measured)
    return samples


@needs_proc
def test_a_read_of_many_mib_maps_about_one_run(
    big: Path, samples: Samples, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four reads of 16 MiB each (a large unit's whole tensors, converted to float64 so that they
    go through the mapping) in runs of 1 MiB here: at most the run and the pages the kernel maps
    around it are mapped at once, not 16 MiB, and nothing once the reads are done."""
    from safetensors.torch import load_file

    monkeypatch.setattr(hf, "_MAPPED_BYTES", 1 * MIB)
    expected = load_file(str(big))
    for _ in range(2):  # the first pass pages in the code a read runs
        source = hf.open_file(big)
        samples.restart()
        try:
            got = {key: _converted(source, key) for key in expected}
            after = _rss_file() - samples.start
        finally:
            source.close()
    assert all(torch.equal(got[key], expected[key].double()) for key in expected)
    assert len(samples.seen) >= 4 * 16, "a 16 MiB read is copied in runs of at most 1 MiB"
    most = max(samples.seen)
    assert most < 5 * MIB, f"{most / MIB:.1f} MiB of the file mapped at once"
    assert after < 1 * MIB, f"{after / MIB:.1f} MiB of the file mapped after the reads"


@needs_proc
def test_the_measure_sees_a_read_that_keeps_its_pages(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measure of the test above can fail: with the file never unmapped, the same reads keep
    every page they touched (64 MiB) mapped."""
    monkeypatch.setattr(hf, "_MAPPED_BYTES", 1 * MIB)
    samples = Samples()
    monkeypatch.setattr(hf._File, "unmap", lambda self: samples.take())
    source = hf.open_file(big)
    samples.restart()
    try:
        for key in source.tensors():
            _converted(source, key)
    finally:
        source.close()
    assert max(samples.seen) > 48 * MIB, f"only {max(samples.seen) / MIB:.1f} MiB mapped"


@needs_proc
def test_small_reads_spread_over_a_file_leave_nothing_mapped(tmp_path: Path) -> None:
    """One-row reads 4 MiB apart, converted (through the mapping): each maps the page-cache folio
    around its row, far more than its 4 KiB, until the file is unmapped, which each read ends
    with. Between reads, and after the source is opened, the file is not mapped at all."""
    from safetensors.torch import save_file

    file = tmp_path / "spread.safetensors"
    save_file({f"w{i}": torch.full((4096, 1024), float(i)) for i in range(4)}, str(file))
    for _ in range(2):  # the first pass pages in the code a read runs
        source = hf.open_file(file)
        assert not _mapped(file), "the source keeps its file mapped after opening it"
        before, most = _rss_file(), 0
        try:
            for key in source.tensors():
                for first in range(0, 4096, 1024):
                    got = _converted(source, key, (slice(first, first + 1),))
                    assert torch.equal(
                        got, torch.full((1, 1024), float(key[1:]), dtype=torch.float64)
                    )
                    most = max(most, _rss_file() - before)
                    assert not _mapped(file), "a read left its file mapped"
        finally:
            source.close()
    assert most < 1 * MIB, f"{most / MIB:.1f} MiB of the file mapped after 16 one-row reads"


def test_runs_of_rows_read_what_load_file_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads cut into runs of a few rows (a 3 KiB budget here), and rows larger than a run:
    whole tensors, row ranges that do not fall on a run's bounds, strided rows and slices of inner
    dims, read as new tensors and into destinations (converted too), equal ``load_file``'s."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(hf, "_MAPPED_BYTES", 3 << 10)
    file = tmp_path / "runs.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file(
        {
            "f32": torch.randn(97, 33, generator=generator),
            "bf16": torch.randn(64, 5, 7, generator=generator).to(torch.bfloat16),
            "i64": torch.arange(300 * 2).reshape(300, 2),
            "wide": torch.randn(5, 2000, generator=generator),  # a row of 8 KB: one a run
            "vector": torch.randn(5000, generator=generator),
            "scalar": torch.tensor(3.5),
        },
        str(file),
    )
    want = load_file(str(file))
    source = hf.open_file(file)
    try:
        for key, full in want.items():
            indexes: list[tuple[slice, ...] | None] = [None]
            if full.dim():
                n = full.shape[0]
                indexes += [(slice(1, n - 1),), (slice(n // 3, n // 3 + 7),), (slice(n, n),)]
                indexes += [(slice(0, None, 2),), (slice(1, n, 3),)]
            if full.dim() > 1:
                indexes += [(slice(2, None), slice(1, 2)), (slice(None), slice(0, 1))]
            assert_reads(source, key, full, indexes)
    finally:
        source.close()


def test_a_destination_of_another_shape_is_refused_before_any_read(big: Path) -> None:
    source = hf.open_file(big)
    try:
        with pytest.raises(ValueError, match=r"'w0'\[0:8\] is \[8, 1024\], the destination"):
            source.read_into("w0", (slice(0, 8),), torch.empty(4, 1024))
    finally:
        source.close()


def test_threads_reading_one_source_read_the_file(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several threads reading rows of one source at once through the mapping (converted): each
    run's unmap drops the handle another thread may be copying from, whose part keeps the
    mapping until its copy is done."""
    from safetensors.torch import load_file

    monkeypatch.setattr(hf, "_MAPPED_BYTES", 256 << 10)
    expected = load_file(str(big))
    source = hf.open_file(big)
    outs = {key: torch.empty(4096, 1024, dtype=torch.float64) for key in expected}
    errors: list[BaseException] = []

    def read(key: str) -> None:
        try:
            for first in range(0, 4096, 512):
                rows = (slice(first, first + 512),)
                source.read_into(key, rows, outs[key][first : first + 512])
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
    assert all(torch.equal(outs[key], expected[key].double()) for key in expected)


needs_preadv = pytest.mark.skipif(not hf._POSITIONAL, reason="no os.preadv, or big-endian")


@needs_proc
@needs_preadv
def test_whole_rows_of_a_plain_dtype_are_positional_reads_of_their_bytes(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's rows in the stored dtype: only their bytes are read, nothing goes through
    safetensors' slices, and the file is never mapped."""
    from safetensors.torch import load_file

    # Copies: load_file's tensors may view a mapping of the file, which would be seen below.
    expected = {key: tensor.clone() for key, tensor in load_file(str(big)).items()}
    assert not _mapped(big)
    read: list[int] = []
    preadv = os.preadv

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = preadv(fd, buffers, offset)
        read.append(got)
        assert not _mapped(big), "the file is mapped during a positional read"
        return got

    def no_slices(self: hf._File, key: str, index: object) -> torch.Tensor:
        raise AssertionError(f"'{key}' went through get_slice")

    monkeypatch.setattr(os, "preadv", counted)
    monkeypatch.setattr(hf._File, "part", no_slices)
    source = hf.open_file(big)
    try:
        got = source.read("w1", (slice(100, 612),))
        out = torch.empty(4096, 1024)
        source.read_into("w2", None, out)
    finally:
        source.close()
    assert torch.equal(got, expected["w1"][100:612])
    assert torch.equal(out, expected["w2"])
    assert sum(read) == (512 + 4096) * 1024 * 4
    assert not _mapped(big)


@needs_preadv
def test_other_reads_go_through_safetensors_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A converted dtype, a column slice, strided rows and a non-contiguous destination are read
    through get_slice, with the values of ``load_file``."""
    from safetensors.torch import load_file, save_file

    file = tmp_path / "other.safetensors"
    save_file({"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(0))}, str(file))
    want = load_file(str(file))["w"]
    parts: list[str] = []
    part = hf._File.part

    def counted(self: hf._File, key: str, index: hf.Index | None) -> torch.Tensor:
        parts.append(key)
        return part(self, key, index)

    monkeypatch.setattr(os, "preadv", lambda *a: pytest.fail("a positional read"))
    monkeypatch.setattr(hf._File, "part", counted)
    source = hf.open_file(file)
    try:
        assert torch.equal(_converted(source, "w"), want.double())
        assert torch.equal(source.read("w", (slice(None), slice(3, 9))), want[:, 3:9])
        assert torch.equal(source.read("w", (slice(0, None, 2),)), want[0::2])
        out = torch.empty(32, 64).t()  # not contiguous
        source.read_into("w", None, out)
        assert torch.equal(out, want)
    finally:
        source.close()
    assert len(parts) >= 4


@needs_preadv
def test_a_file_cut_short_after_opening_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    file = tmp_path / "short.safetensors"
    save_file({"w": torch.ones(256, 256)}, str(file))
    source = hf.open_file(file)
    try:
        os.truncate(file, file.stat().st_size - 4096)
        with pytest.raises(hf.SourceError, match=r"short\.safetensors' ends before 'w' does"):
            source.read("w")
    finally:
        source.close()
