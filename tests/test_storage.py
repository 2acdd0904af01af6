"""Storage: sources read through any pyarrow/fsspec filesystem by URI, folders as paths or file://
URIs, MLflow's artifacts where the config says. `file://` goes through pyarrow's filesystem API,
the code path that serves s3:// and gs:// on a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import zstandard

from corpus.readers import read_lines, read_pile, relative_names
from core import storage
from core.config import ConfigError
from corpus.config import source_files
from pipelines.config import check_inputs_exist, load_config
from core.tracking import MlflowTracker

from conftest import manifest, write_config


def test_the_pile_read_by_uri_equals_the_pile_read_by_path(sample):
    out, planted = sample
    paths = storage.expand(f"{out}/pile/*.jsonl.zst")
    uris = storage.expand(f"{out.as_uri()}/pile/*.jsonl.zst")
    assert uris == [Path(p).as_uri() for p in paths] and len(paths) == 3
    by_path = [r for f, rel in relative_names(paths).items() for r in read_pile(f, "pile", rel)]
    by_uri = [r for f, rel in relative_names(uris).items() for r in read_pile(f, "pile", rel)]
    assert [(r["id"], r["text"], r["reason"]) for r in by_uri] == [(r["id"], r["text"], r["reason"]) for r in by_path]
    assert any(r["reason"].startswith("truncated file: zstd") for r in by_uri)  # a cut file is still seen as cut
    assert sum(not r["reason"] for r in by_uri) > 100
    assert [storage.size(u) for u in uris] == [Path(p).stat().st_size for p in paths]


def test_globs_mean_the_same_for_uris_and_paths(tmp_path):
    for name in ("a/x.zst", "a/y.zst", "a/b/z.zst", "a/b/c/w.zst", "a/notes.txt", "a/x1.zst"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"data")
    cases = {"a/*.zst": ["a/x.zst", "a/x1.zst", "a/y.zst"],  # * stays in its folder
             "a/**/*.zst": ["a/b/c/w.zst", "a/b/z.zst", "a/x.zst", "a/x1.zst", "a/y.zst"],
             "a/?.zst": ["a/x.zst", "a/y.zst"],
             "a/[!y].zst": ["a/x.zst"],
             "a/*/z.zst": ["a/b/z.zst"],
             "a/notes.txt": ["a/notes.txt"],
             "a/missing/*.zst": [], "a/nothing.txt": []}
    root = tmp_path.as_uri()
    for pattern, want in cases.items():
        assert storage.expand(f"{tmp_path}/{pattern}") == [f"{tmp_path}/{w}" for w in want], pattern
        assert storage.expand(f"{root}/{pattern}") == [f"{root}/{w}" for w in want], pattern


def test_a_stream_is_the_stored_bytes_never_decompressed_by_extension(tmp_path):
    data = zstandard.ZstdCompressor().compress(b'{"text": "a"}\n' * 100)
    (tmp_path / "f.jsonl.zst").write_bytes(data[:-5])  # cut: pyarrow's own decompression would raise or hide it
    with storage.open_input((tmp_path / "f.jsonl.zst").as_uri()) as fh:
        assert fh.read() == data[:-5]
    lines = list(read_lines((tmp_path / "f.jsonl.zst").as_uri()))
    assert lines[-1][3].startswith("truncated file")
    with pytest.raises(FileNotFoundError):
        storage.size((tmp_path / "none.zst").as_uri())


def test_a_scheme_pyarrow_lacks_is_served_by_fsspec():
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/dumps/2024/a.jsonl", b'{"text": "hello there"}\n')
    memory.pipe("/dumps/2024/b.txt", b"x")
    assert storage.expand("memory://dumps/*/*.jsonl") == ["memory://dumps/2024/a.jsonl"]
    assert [line for _, _, line, _ in read_lines("memory://dumps/2024/a.jsonl")] == [b'{"text": "hello there"}']
    with pytest.raises(ValueError, match="no filesystem for 'nope://x'"):
        storage.filesystem("nope://x")


def test_folders_are_paths_or_file_uris_and_sources_keep_their_uris(tmp_path, sample):
    out, _ = sample
    cfg = write_config(tmp_path, f"""workdir: "file://{tmp_path}/my%20work"
sources:
  - {{name: pile, format: pile, paths: ["{out.as_uri()}/pile/*.jsonl.zst"]}}
  - {{name: news, format: jsonl, paths: ["s3://bucket/news/*.jsonl.gz"]}}
mlflow: {{artifact_location: "s3://bucket/mlflow"}}
train: {{storage: "file://{tmp_path}/ckpt"}}
""")
    config = load_config(cfg)
    assert config.workdir == f"{tmp_path}/my work" and config.train.storage == f"{tmp_path}/ckpt"
    assert config.sources[0].paths == [f"{out.as_uri()}/pile/*.jsonl.zst"]
    assert config.sources[1].paths == ["s3://bucket/news/*.jsonl.gz"]  # listed when the run starts, not at load
    assert config.mlflow.artifact_location == "s3://bucket/mlflow"
    assert source_files(config.sources[0]) == storage.expand(f"{out.as_uri()}/pile/*.jsonl.zst")
    one_source = f'sources: [{{name: pile, format: pile, paths: ["{out}/pile/*.jsonl.zst"]}}]\n'
    default = load_config(write_config(tmp_path, f"workdir: {tmp_path}/w\n" + one_source, "d"))
    assert default.mlflow.artifact_location == (tmp_path / "w" / "mlartifacts").as_uri()

    for key, text in {"workdir": "workdir: s3://bucket/work", "train.storage": "train: {storage: gs://b/ckpt}",
                      "sample_corpus": "sample_corpus: s3://b/sample"}.items():
        with pytest.raises(ConfigError, match="must be a local folder or a mount every node shares") as err:
            load_config(write_config(tmp_path, text + "\n" + one_source, "bad"))
        assert err.value.key == key

    bad = load_config(write_config(tmp_path, f"""workdir: {tmp_path}/w
sources: [{{name: x, format: jsonl, paths: ["{out.as_uri()}/pile/*.jsonl.zst", "nope://bucket/*.jsonl"]}}]
""", "bad2"))
    with pytest.raises(ConfigError, match=r"cannot list 'nope://bucket/\*.jsonl'") as err:
        check_inputs_exist(bad)
    assert err.value.key == "sources[0].paths[1]"


def test_mlflow_artifacts_go_to_the_configured_location(tmp_path):
    location = (tmp_path / "artifact store").as_uri()
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "e", artifact_location=location)
    with tracker.pipeline("p", params={}, tags={}) as run_id:
        (tmp_path / "logbook.md").write_text("why")
        tracker.client.log_artifact(run_id, str(tmp_path / "logbook.md"))
    stored = list((tmp_path / "artifact store").rglob("logbook.md"))
    assert len(stored) == 1 and stored[0].read_text() == "why"
    assert tracker.client.get_experiment(tracker.experiment_id).artifact_location == location


def test_the_ingest_stage_reads_sources_by_uri_as_by_path(tmp_path, sample, ray_session):
    """The stage end to end (file listing, fingerprint, tasks) with sources given as file:// URIs."""
    import pyarrow.parquet as pq

    from pipelines.full import main

    out, _ = sample
    tables = {}
    for how, root in (("path", str(out)), ("uri", out.as_uri())):
        cfg = write_config(tmp_path, f"""workdir: {tmp_path}/{how}
sources:
  - {{name: pile,   format: pile,  paths: ["{root}/pile/*.jsonl.zst"]}}
  - {{name: ccnews, format: jsonl, paths: ["{root}/ccnews/*.jsonl"], text_field: text, id_field: id}}
""", how)
        assert main(["--config", str(cfg), "--only", "ingest"]) == 0
        m = manifest(tmp_path / how, "ingest")
        tables[how] = (m["counts"], pq.read_table(m["output"], columns=["id", "text", "source", "subset"]).sort_by("id"))
    assert tables["uri"][0] == tables["path"][0] and tables["uri"][0]["rejected"] > 0
    assert tables["uri"][1].equals(tables["path"][1]) and tables["uri"][1].num_rows > 300


def test_a_link_out_of_the_sources_folder_is_refused_by_name_and_one_inside_is_read(tmp_path):
    """`books/zz.txt -> ~/.ray/auth_token` was a document: a file whose path resolves outside the folder above the
    first wildcard (through a link to it, or to a folder above it) is refused with why, by path and by URI alike;
    so is a FIFO, which a reader would wait on forever. A link that stays inside is read."""
    import os

    token = tmp_path / "home" / "auth_token"  # stands in for ~/.ray/auth_token
    token.parent.mkdir()
    token.write_text("secret")
    (tmp_path / "home" / "more").mkdir()
    (tmp_path / "home" / "more" / "b.txt").write_text("secret too")
    books = tmp_path / "books"
    (books / "sub").mkdir(parents=True)
    (books / "a.txt").write_text("a book")
    (books / "zz.txt").symlink_to(token)
    (books / "x.jsonl").symlink_to(token)
    (books / "more").symlink_to(tmp_path / "home" / "more")
    (books / "sub" / "again.txt").symlink_to(books / "a.txt")  # inside: read
    os.mkfifo(books / "pipe.txt")
    outside = f"resolves through a symbolic link to {token}, outside the source's folder: not read"
    for root in (str(books), books.as_uri()):
        assert storage.expand(f"{root}/*.txt") == [f"{root}/a.txt"]
        found = storage.listing(f"{root}/**")
        assert found.files == [f"{root}/a.txt", f"{root}/sub/again.txt"]
        assert found.refused == {f"{root}/more/b.txt": outside.replace(str(token), str(tmp_path / "home/more/b.txt")),
                                 f"{root}/pipe.txt": "not a regular file (a FIFO, device, socket or broken link): not read",
                                 f"{root}/x.jsonl": outside, f"{root}/zz.txt": outside}
        assert storage.listing(f"{root}/zz.txt") == ([], {f"{root}/zz.txt": outside})  # named alone, still refused
