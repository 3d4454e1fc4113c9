"""A smoke run of the benchmark harness: tiny model, one repeat, world size 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.report import targets
from fsdp_builder.tools.cli import main

# What these tests start runs ranks (torchrun, the command line, the harness) on both cores.
pytestmark = pytest.mark.cores(2)

RANK_FIELDS = {"rank", "seconds", "peak_bytes", "baseline_bytes", "comm_bytes", "checksum"}
RECORD_FIELDS = {
    "recipe", "family", "job", "size", "params", "model_bytes", "largest_unit_bytes",
    "world_size", "repeat", "seconds", "peak_bytes", "comm_bytes", "checksum", "ranks", "error",
}  # fmt: skip


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    rc = main(
        ["bench", "--smoke", "--sizes", "1M", "--world-size", "2", "--quiet",
         "--timeout", "60", "--json", str(tmp / "records.json"), "--out", str(tmp / "out")]
    )  # fmt: skip
    return rc, json.loads((tmp / "records.json").read_text()), tmp / "out"


# The smoke run includes the many-small-units case (4 more measurements).
@pytest.mark.timeout(360)
def test_smoke_run_writes_records(smoke: tuple[int, dict, Path]) -> None:
    rc, result, _ = smoke
    failed = [(r["recipe"], r["error"]) for r in result["records"] if r["error"]]
    assert rc == 0, failed
    assert result["torch_version"]
    assert {"cpu_count", "platform", "torch", "backend"} <= set(result["machine"])
    names = {r["recipe"] for r in result["records"]}
    assert {"fsdp1_full", "fsdp1_meta", "fsdp2_meta", "fsdp2_load_bcast", "broadcast_floor",
            "scatter_floor", "builder_fsdp1_reset"} <= names  # fmt: skip
    assert len(result["records"]) == len(names)  # one size, one world size, one repeat
    for r in result["records"]:
        assert RECORD_FIELDS <= set(r), r["recipe"]
        assert (r["world_size"], r["repeat"], r["size"]) == (2, 0, "1M")
        assert r["seconds"] > 0 and r["peak_bytes"] >= 0
        assert [x["rank"] for x in r["ranks"]] == [0, 1]
        for x in r["ranks"]:
            assert RANK_FIELDS <= set(x)
            assert 0 < x["seconds"] <= r["seconds"]
        if r["deterministic"]:
            assert isinstance(r["checksum"], str), r["recipe"]


@pytest.mark.timeout(30)
def test_deterministic_recipes_agree(smoke: tuple[int, dict, Path]) -> None:
    _, result, _ = smoke
    sums = {r["recipe"]: r["checksum"] for r in result["records"] if r["checksum"]}
    # Loading rank 0's state dict gives the weights that seeded construction gives.
    loaded = [
        sums[n] for n in ("fsdp1_full", "fsdp2_load_bcast", "builder_fsdp2_load") if n in sums
    ]
    assert len(loaded) >= 2 and len(set(loaded)) == 1, sums
    # So does reading the same weights from a .safetensors file or a DCP folder, by any recipe.
    files = ("fsdp2_file_bcast", "fsdp2_file_slices", "builder_fsdp2_checkpoint",
             "builder_fsdp1_checkpoint", "fsdp2_dcp_load", "builder_fsdp2_dcp")  # fmt: skip
    missing_files = [n for n in files if n not in sums]
    assert not missing_files, missing_files
    assert {sums[n] for n in files} == {loaded[0]}, sums
    # Deterministic init is the same whichever backend shards it. The smoke run includes every
    # recipe (no --recipes), so both must have run and reported a checksum.
    errors = {r["recipe"]: r["error"] for r in result["records"]}
    det = ("builder_fsdp1_det", "builder_fsdp2_det")
    missing = {n: errors.get(n, "not in the records") for n in det if n not in sums}
    assert not missing, missing
    assert sums[det[0]] == sums[det[1]], sums


@pytest.mark.timeout(30)
def test_rank_local_loads_send_no_weights(smoke: tuple[int, dict, Path]) -> None:
    _, result, _ = smoke
    local = {"builder_fsdp2_checkpoint", "builder_fsdp1_checkpoint", "builder_fsdp2_dcp"}
    found = [r for r in result["records"] if r["recipe"] in local]
    assert {r["recipe"] for r in found} == local
    for r in found:
        # Counted on every rank: collectives happen (validation), but carry no weights.
        assert [x["weight_comm_bytes"] for x in r["ranks"]] == [0, 0], r["recipe"]
        assert all(x["comm_bytes"] is not None for x in r["ranks"]), r["recipe"]
    rows = [t for t in targets(result) if "weight bytes sent between ranks" in t["target"]]
    assert len(rows) == len(local) and all(t["met"] for t in rows), rows


@pytest.mark.timeout(30)
def test_smoke_run_writes_table_and_plot(smoke: tuple[int, dict, Path]) -> None:
    _, result, out = smoke
    md = (out / "bench.md").read_text()
    assert "| target |" in md and "| recipe |" in md.replace("| W | size | recipe |", "| recipe |")
    for r in result["records"]:
        assert r["recipe"] in md
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(30)
def test_summary_prints_targets_and_warnings(smoke: tuple[int, dict, Path]) -> None:
    from benchmarks.report import console_summary

    _, result, _ = smoke
    assert all(isinstance(r["warnings"], list) for r in result["records"])
    result = {**result, "warnings": {"UserWarning: w": {"count": 2, "first": "a 1M w2"}}}
    text = console_summary(result)
    assert "| target |" in text and "overhead:" in text
    assert "UserWarning: w (2 measurement(s), first: a 1M w2)" in text


def test_warnings_and_stderr_are_captured(capfd: pytest.CaptureFixture[str]) -> None:
    import os
    import warnings

    from benchmarks.harness import captured_warnings

    with captured_warnings() as lines:
        warnings.warn("from python", UserWarning, stacklevel=1)
        os.write(2, b"[W1130 03:42:27.123456 99 file.cpp:1] from c++\n")
    assert lines == ["UserWarning: from python", "from c++"]
    assert capfd.readouterr().err == ""


@pytest.mark.timeout(30)
def test_smoke_run_measures_many_small_units(smoke: tuple[int, dict, Path]) -> None:
    _, result, out = smoke
    records = result["units"]["records"]
    assert {r["recipe"] for r in records} == {
        "plain_fsdp2", "builder_fsdp2", "plain_fsdp1", "builder_fsdp1"
    }  # fmt: skip
    for r in records:
        assert r["error"] is None, r["error"]
        assert r["seconds"] > 0 and r["cpu_seconds"] > 0 and r["collect_cpu_seconds"] > 0
        assert [x["rank"] for x in r["ranks"]] == [0, 1]
    ratios = {r["backend"]: r for r in result["units"]["ratios"]}
    assert set(ratios) == {"fsdp1", "fsdp2"}
    by_recipe = {r["recipe"]: r for r in records}  # one repeat in the smoke run
    for backend, r in ratios.items():
        assert r["wall_ratio"] == pytest.approx(r["builder_seconds"] / r["plain_seconds"])
        built, plain = by_recipe[f"builder_{backend}"], by_recipe[f"plain_{backend}"]
        with_collect = [x["cpu_seconds"] + x["collect_cpu_seconds"] for x in (built, plain)]
        assert r["collect_ratio"] == pytest.approx(with_collect[0] / with_collect[1])
    assert "## Many small units" in (out / "bench.md").read_text()
    assert (out / "units.png").stat().st_size > 0


@pytest.mark.timeout(30)
def test_units_ab_tables_the_sides_a_folder_holds(
    smoke: tuple[int, dict, Path], tmp_path: Path
) -> None:
    """The A/B table pairs each builder build with the plain build of its repeat; a folder of
    re-measurements (only "after" runs) gets rows for that side alone."""
    from benchmarks.units_ab import side_rows

    _, result, _ = smoke
    text = json.dumps(result)
    for name in ("after1.json", "after2.json"):
        (tmp_path / name).write_text(text)
    records = {(r["backend"], r["family"]): r for r in result["units"]["records"]}
    for backend in ("fsdp1", "fsdp2"):
        row = side_rows(tmp_path, "after", backend)
        assert row is not None and row.startswith(f"| {backend} | after | 2 |")
        paired = (
            records[backend, "builder"]["cpu_seconds"] / records[backend, "baseline"]["cpu_seconds"]
        )
        assert f"| {paired:.2f} | {paired:.2f}\u2013{paired:.2f} |" in row
        assert side_rows(tmp_path, "before", backend) is None
    (tmp_path / "before1.json").write_text(text)  # one build: too few for a row
    assert side_rows(tmp_path, "before", "fsdp2") is None
    (tmp_path / "before2.json").write_text(text)
    assert side_rows(tmp_path, "before", "fsdp2") is not None


@pytest.mark.timeout(30)
def test_a_units_only_report_describes_that_run(smoke: tuple[int, dict, Path]) -> None:
    """``--units-only`` records no model recipe: its report names the unit counts and world
    sizes it measured, not the default model sizes, and has no empty model tables."""
    from benchmarks.report import render_markdown

    _, result, _ = smoke
    only_units = {**result, "records": [], "recipes": {}}
    text = render_markdown(only_units)
    counts = sorted({r["units"] for r in result["units"]["records"]})
    assert f"many small units only: {', '.join(map(str, counts))} units; world sizes 2;" in text
    assert "## Many small units" in text
    assert "## Targets" not in text and "## Medians" not in text and "sizes 1M" not in text
    assert "## Targets" in render_markdown(result)  # the control: the full run has them


@pytest.mark.timeout(30)
def test_memory_split_is_recorded_per_rank(smoke: tuple[int, dict, Path]) -> None:
    _, result, _ = smoke
    for r in result["records"]:
        if r["error"]:
            continue
        for x in r["ranks"]:
            assert x["peak_anon_bytes"] is not None and x["peak_anon_bytes"] >= 0
            assert x["peak_file_bytes"] is not None
        assert r["peak_anon_bytes"] == max(x["peak_anon_bytes"] for x in r["ranks"])


def test_progress_prints_a_line_per_measurement_off_a_terminal() -> None:
    import io

    from benchmarks.progress import Progress

    stream = io.StringIO()  # not a TTY
    progress = Progress(3, quiet=False, stream=stream)
    for i, label in enumerate(("a", "b", "c")):
        progress.start(label)
        progress.done(label, 0.5 * (i + 1), "boom\nlast line" if label == "c" else None)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["[1/3] a: 0.500 s", "[2/3] b: 1.000 s", "[3/3] c: FAILED: last line"]
    assert "\r" not in stream.getvalue()


def test_quiet_progress_prints_nothing() -> None:
    import io

    from benchmarks.progress import Progress

    stream = io.StringIO()
    progress = Progress(1, quiet=True, stream=stream)
    progress.done("a", 1.0)
    assert stream.getvalue() == ""


def test_rss_split_tells_heap_from_mapped_file(tmp_path: Path) -> None:
    import mmap

    from benchmarks.harness import RssSplit

    size = 64 * 1024 * 1024
    path = tmp_path / "blob"
    path.write_bytes(b"\1" * size)
    split = RssSplit(interval=0.001)
    split.start()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, size, 4096)) == size // 4096  # touch every page
        split._take()
    anon_after_map = split.peak[0]
    heap = bytearray(b"\1" * size)  # anonymous pages, written
    split._take()
    anon, file = split.stop()
    del heap
    assert file >= size * 0.9  # the mapping's pages are file-backed
    assert anon >= size * 0.9  # the bytearray's are anonymous
    assert anon_after_map - split.baseline[0] < size * 0.5  # mapping did not count as heap


@pytest.mark.timeout(300)
def test_call_counts_split_a_build_by_stage() -> None:
    """Counted on fresh ranks: FSDP2's ``fully_shard`` makes no more calls on the builder's
    path than on plain's (to within 1 %: torch's caches decide a few dozen; the builder shards
    these small units once filled, which takes a few % fewer), only the builder has configure,
    prepare and finish stages, and counts repeat between runs. Timed (``--cpu``), each further
    build's thread CPU seconds are split over the same stages."""
    from benchmarks.calls import STAGES, count_calls
    from benchmarks.harness import launch

    timed: dict[str, list[dict[str, float]]] = {}

    def counted(name: str, builds: int = 0) -> dict[str, int]:
        ranks = launch(count_calls, 2, name, 8, 16, builds, timeout=240, backend="gloo")
        counts = dict(ranks[0])
        timed[name] = counts.pop("cpu_seconds", [])
        return counts

    plain, built = counted("plain_fsdp2", builds=2), counted("builder_fsdp2")
    assert len(timed["plain_fsdp2"]) == 2 and timed["builder_fsdp2"] == []
    for seconds in timed["plain_fsdp2"]:
        assert set(seconds) <= set(STAGES) and min(seconds.values()) >= 0
        assert seconds["fully_shard"] > 0 and seconds["make_stack"] > 0
        assert not {"configure", "prepare", "finish"} & set(seconds)
    assert plain["fully_shard"] > 0
    assert plain["fully_shard"] * 0.9 < built["fully_shard"] <= plain["fully_shard"] * 1.01
    assert plain["make_stack"] == built["make_stack"] > 0
    assert not {"configure", "prepare", "finish"} & set(plain)
    assert built["configure"] > 0 and built["prepare"] > 0 and built["finish"] > 0
    again = counted("builder_fsdp2", builds=2)
    total, total_again = sum(built.values()), sum(again.values())
    assert abs(total - total_again) <= total // 100, (total, total_again)
    for seconds in timed["builder_fsdp2"]:
        assert set(seconds) <= set(STAGES) and min(seconds.values()) >= 0
        assert seconds["configure"] > 0 and seconds["fully_shard"] > 0


@pytest.mark.timeout(240)
def test_against_a_revision_runs_both_libraries_in_pairs(tmp_path: Path) -> None:
    """``python -m benchmarks.against REV`` against HEAD itself, one pair of tiny builds: the
    report has both sides' ratios, and the REV side's ranks imported the tree taken from git,
    not the working tree's library."""
    import subprocess

    from benchmarks import against

    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=True, capture_output=True, text=True,
        cwd=against.REPO,
    ).stdout.strip()  # fmt: skip
    out, records = tmp_path / "against.md", tmp_path / "against.json"
    rc = against.main(
        ["HEAD", "--kinds", "units", "--units", "4", "--world", "1", "--pairs", "1",
         "--recipes", "plain_fsdp2,builder_fsdp2", "--timeout", "90",
         "--out", str(out), "--json", str(records)]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(records.read_text())
    assert result["rev"] == head
    rev_lib = Path(result["rev_library"]) / "fsdp_builder"
    tree_lib = against.REPO / "fsdp_builder"
    assert rev_lib != tree_lib
    # Each side ran in its own child, whose ranks imported that side's library.
    assert sorted((c["side"], c["library"]) for c in result["children"]) == [
        ("head", str(tree_lib)),
        ("rev", str(rev_lib)),
    ]
    seen = {(r["side"], r["recipe"]): r["libraries"] for r in result["records"]}
    assert seen == {
        ("head", "plain_fsdp2"): [str(tree_lib)],
        ("head", "builder_fsdp2"): [str(tree_lib)],
        ("rev", "plain_fsdp2"): [str(rev_lib)],
        ("rev", "builder_fsdp2"): [str(rev_lib)],
    }
    assert all(r["cpu_seconds"] > 0 and r["seconds"] > 0 for r in result["records"])
    (row,) = [r for r in result["rows"] if r["recipe"] == "builder_fsdp2"]
    assert row["plain"] == "plain_fsdp2"
    for key in ("head_rev_cpu_seconds", "head_rev_seconds", "head_plain_cpu_seconds",
                "rev_plain_cpu_seconds", "head_plain_seconds", "rev_plain_seconds"):  # fmt: skip
        spread = row[key]
        assert set(spread) == {"min", "median", "max"}, key
        assert 0 < spread["min"] <= spread["median"] <= spread["max"], key
    by = {(r["side"], r["recipe"]): r for r in result["records"]}
    head_b, rev_b = by[("head", "builder_fsdp2")], by[("rev", "builder_fsdp2")]
    assert row["head_rev_cpu_seconds"]["median"] == head_b["cpu_seconds"] / rev_b["cpu_seconds"]
    head_p, rev_p = by[("head", "plain_fsdp2")], by[("rev", "plain_fsdp2")]
    controlled = (head_b["cpu_seconds"] / head_p["cpu_seconds"]) / (
        rev_b["cpu_seconds"] / rev_p["cpu_seconds"]
    )
    assert row["head_rev_controlled_cpu_seconds"]["median"] == pytest.approx(controlled)
    text = out.read_text()
    assert "| units | builder_fsdp2 |" in text and "HEAD ÷ REV, CPU" in text


@pytest.mark.timeout(240)
@pytest.mark.cores(2)
def test_in_process_ab_builds_both_libraries_in_the_same_ranks(tmp_path: Path) -> None:
    """``benchmarks.inprocess_ab``: the revision's copy keeps no word of the working tree's
    package, and each rank builds with both: the copy's builder from the copy."""
    import re

    from benchmarks import inprocess_ab
    from fsdp_builder.tools.launch import run_ranks

    inprocess_ab.renamed_copy("HEAD", tmp_path)
    sources = list((tmp_path / inprocess_ab.RENAMED).rglob("*.py"))
    assert sources and not (tmp_path / "fsdp_builder").exists()
    assert not [p for p in sources if re.search(r"\bfsdp_builder\b", p.read_text())]
    results = run_ranks(
        inprocess_ab.rank, 2, str(tmp_path), ["builder_fsdp2"], 3, 4, timeout=180.0,
        start_method="forkserver",
    )  # fmt: skip
    for found, libraries in results:
        assert found == results[0][0]  # CPU summed over the ranks: the same on each
        assert libraries == {
            "head": str(Path(inprocess_ab.__file__).parents[1] / "fsdp_builder"),
            "rev": str(tmp_path / inprocess_ab.RENAMED),
        }
    sides = results[0][0]["builder_fsdp2"]
    assert set(sides) == {"head", "rev", "plain"}
    assert all(len(v) == 3 and min(v) > 0 for v in sides.values())
    table = inprocess_ab.render(results[0][0], "tree", "rev")
    assert "| builder_fsdp2 | 3 |" in table


def test_shard_order_times_both_orders_of_the_same_plain_work() -> None:
    """``benchmarks.shard_order``: both orders give the same shards from the same seed (so
    they compare equal work), each build is split into its three parts, and the summary holds
    both rows and the per-repeat ratio."""
    from benchmarks import shard_order
    from fsdp_builder.tools.launch import run_ranks

    results = run_ranks(
        shard_order.rank, 2, 6, 3, timeout=180.0, start_method="forkserver"
    )  # fmt: skip
    for result in results:
        assert result["same_values"] is True
        builds = result["builds"]
        assert set(builds) == {"batched", "per_unit"}
        for runs in builds.values():
            assert len(runs) == 3
            assert all(set(parts) == set(shard_order.PARTS) for parts in runs)
            assert all(min(parts.values()) > 0 for parts in runs)
    table = shard_order.summary(results[0]["builds"])
    assert "| batched |" in table and "| per_unit |" in table and "**median" in table
