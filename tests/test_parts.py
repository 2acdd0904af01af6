"""Parquet parts written by file tasks: rows kept in order, parts rolled over, small files packed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from corpus.parts import DOCUMENT_SCHEMA, DROPPED_SCHEMA, Parts, group_by_size, iter_rows, parquet_bytes, parquet_files, row_group_ranges, rows_in_folder


def test_parts_roll_over_and_keep_every_row_in_order(tmp_path):
    parts = Parts(tmp_path / "out", "src-00000", DOCUMENT_SCHEMA, part_bytes=1000)
    docs = [{"id": str(i), "text": "x" * 90 + str(i), "source": "s", "subset": "s", "meta": "{}"} for i in range(5000)]
    for d in docs:
        parts.add(d, len(d["text"]))
    assert parts.close() == 5000
    files = parquet_files(tmp_path / "out")
    assert len(files) > 100 and files[0].endswith("src-00000-0000.parquet")
    assert [r for f in files for r in iter_rows(f)] == docs
    assert rows_in_folder(tmp_path / "out") == 5000


def test_a_parts_footer_states_its_key_columns_not_its_text(tmp_path):
    """The run summary counts a row group's documents by `source` from its statistics; a text's min and max would be
    two documents' first kilobytes a row group, parsed in the driver by every footer read."""
    parts = Parts(tmp_path, "web-00000", DROPPED_SCHEMA)
    for i in range(5000):
        parts.add({"id": f"d{i:05d}", "text": "w" * 3000 + str(i), "source": "web", "subset": "web", "meta": "{}",
                   "reason": "short"}, 3000)
    parts.close()
    meta = pq.ParquetFile(parquet_files(tmp_path)[0]).metadata
    group = meta.row_group(1)
    stated = {group.column(i).path_in_schema: group.column(i).is_stats_set for i in range(group.num_columns)}
    assert stated == {"id": True, "text": False, "source": True, "subset": True, "meta": False, "reason": True}
    assert (group.column(2).statistics.min, group.column(0).statistics.max) == ("web", "d04095")
    assert meta.num_row_groups == 3 and meta.serialized_size < 1000 * meta.num_row_groups  # 6.7 KB each with the text's


def test_parts_with_no_rows_write_no_file(tmp_path):
    assert Parts(tmp_path / "none", "x", pa.schema([("a", pa.int64())])).close() == 0
    assert parquet_files(tmp_path / "none") == [] and rows_in_folder(tmp_path / "none") == 0


def test_small_files_are_packed_and_big_ones_stand_alone(tmp_path):
    sizes = {"a": 10, "b": 10, "c": 100, "d": 5, "e": 5, "f": 5}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    on_disk = {str(tmp_path / n): (tmp_path / n).stat().st_size for n in sizes}
    groups = group_by_size(on_disk, target_bytes=20)
    assert [[p[-1] for p in g] for g in groups] == [["a", "b"], ["c"], ["d", "e", "f"]]
    groups = group_by_size(on_disk, target_bytes=12)
    assert [[p[-1] for p in g] for g in groups] == [["a", "b"], ["c"], ["d", "e", "f"]]
    groups = group_by_size(on_disk, target_bytes=8)
    assert [[p[-1] for p in g] for g in groups] == [["a"], ["b"], ["c"], ["d", "e"], ["f"]]
    assert group_by_size({}, 20) == []


def test_row_group_ranges_cover_every_group_once(tmp_path):
    parts = Parts(tmp_path, "p", DOCUMENT_SCHEMA)
    for i in range(10_000):
        parts.add({"id": str(i), "text": "y" * 500, "source": "s", "subset": "s", "meta": "{}"}, 500)
    parts.close()
    files = parquet_files(tmp_path)
    total = parquet_bytes(files)
    ranges = row_group_ranges(files, total // 3)
    assert 3 <= len(ranges) <= 5
    groups = [g for _, run in ranges for g in run]
    assert groups == list(range(len(groups))) and len(groups) == 5  # 10,000 rows in groups of 2,048
    assert [r["id"] for f, run in ranges for r in iter_rows(f, ["id"], run)] == [str(i) for i in range(10_000)]
    assert len(row_group_ranges(files, 1 << 40)) == 1


def test_an_input_stages_output_that_is_missing_short_or_unreadable_is_an_error_never_empty(tmp_path):
    """What each stage reads its input with (corpus.parts.input_parts): the committed rows or an error naming the
    path and the counts. Before it, a missing folder was read as no parts, and a stage as zero rows, exit 0."""
    import pytest

    from corpus.parts import input_parts

    parts = Parts(tmp_path / "out", "part", pa.schema([("a", pa.int64())]), part_bytes=10)
    for i in range(3):
        parts.add({"a": i}, 8)
    parts.close()
    inputs = {"dedup": {"output": str(tmp_path / "out"), "counts": {"rows_out": 3}}}
    assert input_parts(inputs, "dedup") == parquet_files(tmp_path / "out") and len(input_parts(inputs, "dedup")) == 2
    inputs["dedup"]["counts"]["rows_out"] = 4
    with pytest.raises(RuntimeError, match=r"out: 3 rows in 2 part\(s\), but dedup committed 4"):
        input_parts(inputs, "dedup")
    first = parquet_files(tmp_path / "out")[0]
    with open(first, "r+b") as f:
        f.truncate(20)
    with pytest.raises(RuntimeError, match=f"{first}: dedup's output cannot be read"):
        input_parts(inputs, "dedup")
    inputs["dedup"]["output"] = str(tmp_path / "moved-away")
    with pytest.raises(FileNotFoundError, match=r"moved-away: dedup's output is missing \(4 rows committed there\)"):
        input_parts(inputs, "dedup")


def test_a_task_is_a_frozen_dataclass_checked_on_the_driver():
    """run_tasks refuses a dict before anything reaches Ray, and a task's misspelt field fails where it is built."""
    from corpus.normalize import NormalizeTask
    from corpus.parts import run_tasks

    with pytest.raises(TypeError, match="frozen dataclasses of one kind"):
        run_tasks(lambda task: {}, [{"path": "x.parquet", "row_groups": [0]}])
    with pytest.raises(TypeError, match="row_group"):
        NormalizeTask(path="x.parquet", row_group=(0,), stem="x", config=None, eval=None, output="o", dropped="d",
                      eval_folder="e")
