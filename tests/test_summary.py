"""The run summary's count of documents by source (pipelines/summary.py), against a count of the column itself."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.summary import documents_by_source


def test_documents_by_source_counts_from_footers_where_a_row_group_is_one_source_and_reads_the_rest(tmp_path, monkeypatch):
    docs = tmp_path / "normalize"
    docs.mkdir()
    mixed = ["reddit", "reddit", "pile", "reddit", "pile", None, "books"]
    pq.write_table(pa.table({"id": [str(i) for i in range(7)], "source": mixed}), docs / "mixed.parquet", row_group_size=2)
    pq.write_table(pa.table({"id": ["a", "b", "c"], "source": ["books"] * 3}), docs / "books.parquet", row_group_size=2)
    other = tmp_path / "train"  # not a document stage
    other.mkdir()
    pq.write_table(pa.table({"source": ["x"]}), other / "p.parquet")
    no_source = tmp_path / "dedup"  # a document stage's output without a source column (a test's own stage)
    no_source.mkdir()
    pq.write_table(pa.table({"id": ["x"]}), no_source / "p.parquet")
    reads = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: reads.append(i) or read_row_group(self, i, **kw))
    outcomes = [SimpleNamespace(stage=stage, manifest={"output": str(folder)})
                for stage, folder in (("normalize", docs), ("train", other), ("dedup", no_source))]
    assert documents_by_source(outcomes) == {"normalize": dict(collections.Counter(mixed + ["books"] * 3))}
    # mixed.parquet's groups: [reddit reddit] and [books] from its footer; [pile reddit] and [pile None] read (a
    # null is not one source by the footer's count). books.parquet's two: from its footer.
    assert reads == [1, 2]
