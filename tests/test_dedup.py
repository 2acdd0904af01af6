"""The dedup stage on Ray: what is merged and what never is, chains, the kept document, reruns."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import ROOT, write_config
from corpus.sample import WORDS, jaccard, prose, _rng
from pipelines.full import main


def edit(text: str, positions: list[int], seed: int) -> str:
    words, rng = text.split(" "), random.Random(seed)
    for i in positions:
        words[i] = rng.choice([w for w in WORDS if w != words[i]])
    return " ".join(words)


def long_doc(seed: int, words: int = 2000) -> str:
    rng, out = _rng(21, seed), []
    while len(out) < words:
        out.extend(prose(rng, (3, 6)).split())
    return " ".join(out[:words])


def rows(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources (news first, so its copies are the ones kept) with every case the issue names."""
    root = tmp_path_factory.mktemp("dedup")
    base = [long_doc(i) for i in range(6)]
    chain_a = base[3]
    chain_b = edit(chain_a, list(range(100, 2000, 250)), 1)  # 8 words changed
    chain_c = edit(chain_b, list(range(225, 2000, 250)), 2)  # 8 others
    docs = {
        "news": {"n-exact": base[0], "n-space": base[1], "n-oneword": base[2], "n-edited": base[4], "n-chain-a": chain_a,
                 "n-unique": base[5]},
        "web": {"w-exact": base[0], "w-space": base[1].replace(" ", "  \t ", 40),
                "w-oneword": edit(base[2], [1000], 3), "w-edited": edit(base[4], list(range(0, 2000, 7)), 4),
                "w-chain-b": chain_b, "w-chain-c": chain_c,
                "w-self1": "short document that appears twice in one source", "w-self2": "short document that appears twice in one source"},
    }
    for name, texts in docs.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    cfg = write_config(root, f"""
workdir: {root}/work
normalize: {{whitespace: false}}   # so the whitespace variant reaches dedup as it was written
sources:
  - {{name: news, format: jsonl, id_field: id, paths: ["{root}/news.jsonl"]}}
  - {{name: web,  format: jsonl, id_field: id, paths: ["{root}/web.jsonl"]}}
""")
    return root, cfg, docs, (chain_a, chain_b, chain_c)


@pytest.fixture(scope="module")
def deduped(corpus, ray_session):
    root, cfg, _, _ = corpus
    assert main(["--config", str(cfg), "--only", "ingest,normalize,dedup"]) == 0
    manifest = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    return manifest, Path(manifest["output"]).parent


def test_the_cases_are_what_they_say(corpus):
    _, _, docs, (a, b, c) = corpus
    n, w = docs["news"], docs["web"]
    assert jaccard(n["n-oneword"], w["w-oneword"]) > 0.99
    assert jaccard(n["n-edited"], w["w-edited"]) < 0.5  # 15% of the words changed
    assert jaccard(a, b) >= 0.95 and jaccard(b, c) >= 0.95 and jaccard(a, c) < 0.95


def test_merges_exactly_the_pairs_at_or_above_the_threshold(deduped):
    manifest, folder = deduped
    dups = {r["id"]: r for r in rows(folder / "duplicates")}
    assert set(dups) == {"w-exact", "w-space", "w-oneword", "w-chain-b", "w-chain-c", "w-self2"}
    kept = {r["id"] for r in rows(folder / "output")}
    assert {"n-exact", "n-space", "n-oneword", "n-edited", "w-edited", "n-chain-a", "n-unique", "w-self1"} == kept
    assert manifest["counts"] == {"rows_in": 14, "rows_out": 8, "duplicate": 6}
    # The source listed first is kept; a chain a~b~c (a and c below the threshold) keeps only a.
    assert dups["w-exact"]["kept_id"] == "n-exact" and dups["w-exact"]["jaccard"] == 1.0
    assert dups["w-chain-c"]["kept_id"] == "n-chain-a" and dups["w-chain-c"]["via"] == "w-chain-b"
    assert 0.95 <= dups["w-chain-c"]["jaccard"] < 1
    assert dups["w-self2"]["kept_id"] == "w-self1" and dups["w-self2"]["kept_source"] == "web"
    # Every checked candidate is written down with its exact Jaccard; none below the threshold merged.
    candidates = rows(folder / "candidates")
    assert {(c["a"], c["b"]) for c in candidates} >= {("n-chain-a", "w-chain-b"), ("w-chain-b", "w-chain-c")}
    below = [c for c in candidates if c["jaccard"] < 0.95]
    assert all(c["b"] not in dups or (c["a"], c["b"]) not in {(d["via"], d["id"]) for d in dups.values()} for c in below)
    assert manifest["metrics"]["duplicates.web.of.news"] == 5 and manifest["metrics"]["duplicates.web.of.web"] == 1
    assert json.loads((folder / "cluster_sizes.json").read_text()) == {"2": 4, "3": 1}


def test_mlflow_has_the_counts_and_the_histogram(corpus, deduped):
    root, *_ = corpus
    manifest, _ = deduped
    client = MlflowClient(f"sqlite:///{root}/work/mlflow.db")
    run = client.get_run(manifest["mlflow_run_id"])
    assert run.data.metrics["duplicate"] == 6 and run.data.metrics["verified_pairs"] >= 5
    assert run.data.params["threshold"] == "0.95"
    assert "cluster_sizes.png" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_rerun_with_one_cpu_and_the_hash_shuffle_keeps_the_same_documents(corpus, deduped):
    """A fresh process, a Ray with 1 CPU, `--only dedup --force`, and every groupby on Ray Data's hash
    shuffle (the cluster's path; the first run took the task-based sort shuffle of small data): the
    same decisions."""
    root, cfg, _, _ = corpus
    manifest, folder = deduped
    before = sorted((r["id"], r["kept_id"]) for r in rows(folder / "duplicates"))
    first_log = (folder / "stage.log").read_text()  # the rerun replaces this folder (the same fingerprint)
    subprocess.run([sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(cfg), "--only", "dedup",
                    "--force", "--set", "ray.num_cpus=1", "--set", "ray.small_shuffle_mb=0"], check=True, capture_output=True, cwd=ROOT)
    again = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    assert again["fingerprint"] == manifest["fingerprint"]  # num_cpus is not part of dedup's config
    assert again["mlflow_run_id"] != manifest["mlflow_run_id"]
    assert sorted((r["id"], r["kept_id"]) for r in rows(Path(again["output"]).parent / "duplicates")) == before
    # Which shuffle each run took, from Ray Data's execution plans in the stage logs; both read Parquet with
    # the V1 reader (V2 would start 32 footer-reader actors per read).
    again_log = (Path(again["output"]).parent / "stage.log").read_text()
    assert "AllToAllOperator[Sort]" in first_log and "HashShuffle" not in first_log
    assert "HashShuffleMap(keys=('part',), partitions=1)" in again_log and "[Sort]" not in again_log
    assert "ReadParquet" in first_log and "ReadFilesParquetV2" not in first_log + again_log
