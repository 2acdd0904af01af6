"""The dedup stage on Ray: what is merged and what never is, chains, the kept document, reruns."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
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
    chain_x = edit(chain_b, list(range(30, 2000, 50)), 3)  # 40 others: Jaccard ~0.8 to b, ~0.75 to c
    docs = {
        "news": {"n-exact": base[0], "n-space": base[1], "n-oneword": base[2], "n-edited": base[4], "n-chain-a": chain_a,
                 "n-unique": base[5], "n-chain-x": chain_x},
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
    return root, cfg, docs, (chain_a, chain_b, chain_c, chain_x)


@pytest.fixture(scope="module")
def deduped_run(corpus, ray_session):
    """The stages to dedup: its manifest, its folder, and how many object references the driver owned each time
    dedup's progress bar moved (a phase had ended)."""
    import ray

    from core.console import Bar

    root, cfg, _, _ = corpus
    owned: list[int] = []
    update_to = Bar.update_to  # Bar.update calls it too

    def counted(bar: Bar) -> None:
        if bar.unit == "phases":  # the stage's own bar, not one of a phase's tasks
            # Ray Data's executor thread lets go of its last outputs on its own, within moments; garbage in a cycle
            # waits for the collector, which does not run while the stage stands still here.
            deadline = time.monotonic() + 2
            while (n := len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            owned.append(n)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Bar, "update_to", lambda self, *a, **k: (counted(self), update_to(self, *a, **k))[1])
        assert main(["--config", str(cfg), "--only", "ingest,normalize,dedup"]) == 0
    manifest = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    return manifest, Path(manifest["output"]).parent, owned


@pytest.fixture(scope="module")
def deduped(deduped_run):
    return deduped_run[:2]


def test_no_phase_leaves_an_object_in_the_driver(deduped_run):
    """Ray Data's datasets sit in reference cycles: a phase's, garbage once it returns, held their blocks in the object
    store and each block's task specification in the driver until Python's cyclic collector ran, phases later.
    dedup/stage.py collects as each phase ends: the driver owns no object reference when the stage's bar moves."""
    owned = deduped_run[2]
    assert len(owned) >= 6 and set(owned) == {0}, owned  # 8 to 46 references as phases ended, before it collected


def test_the_cases_are_what_they_say(corpus):
    from corpus.config import DecontaminateConfig
    from dedup.decontaminate import distinct, ngrams

    _, _, docs, (a, b, c, x) = corpus
    n, w = docs["news"], docs["web"]
    assert jaccard(n["n-oneword"], w["w-oneword"]) > 0.99
    assert jaccard(n["n-edited"], w["w-edited"]) < 0.5  # 15% of the words changed
    assert jaccard(a, b) >= 0.95 and jaccard(b, c) >= 0.95 and jaccard(a, c) < 0.95
    assert 0.7 < jaccard(x, c) < jaccard(x, b) < 0.9  # a near-duplicate at dedup.threshold 0.7, not at 0.95
    # ... which shares more than half its 13-grams with c (eval.decontaminate's default), as a and b do.
    docs_of, grams = distinct(*ngrams([a, b, c, x], DecontaminateConfig().ngram))
    sets = [set(grams[docs_of == i].tolist()) for i in range(4)]
    assert all(0.5 < len(sets[i] & sets[2]) / min(len(sets[i]), len(sets[2])) < 0.99 for i in (0, 1, 3))


def test_merges_exactly_the_pairs_at_or_above_the_threshold(deduped):
    manifest, folder = deduped
    dups = {r["id"]: r for r in rows(folder / "duplicates")}
    assert set(dups) == {"w-exact", "w-space", "w-oneword", "w-chain-b", "w-chain-c", "w-self2"}
    kept = {r["id"] for r in rows(folder / "output")}
    assert {"n-exact", "n-space", "n-oneword", "n-edited", "w-edited", "n-chain-a", "n-unique", "w-self1", "n-chain-x"} == kept
    assert manifest["counts"] == {"rows_in": 15, "rows_out": 9, "duplicate": 6, "near_eval": 0}
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


def test_a_copy_of_an_evaluation_document_never_trains_whatever_the_dedup_threshold(corpus, deduped):
    """Decontamination, dedup's first phase with eval.decontaminate's settings, removes every training document that
    shares more than half its 13-grams with an evaluation document (`near_eval`, that document as `kept_id`), before
    dedup's own phases, which never see it. So a dedup ablation removes exactly the same documents: 0.95 (base) and
    0.7, where n-chain-x (Jaccard ~0.8 to w-chain-b) would have joined the evaluation document's component (and at
    0.99 the chain a~b~c would have left it).
    The evaluation set is never removed, and its fingerprint does not change with dedup.*."""
    from corpus.evalset import drawn

    root, cfg, docs, _ = corpus
    names = [(s, i) for s, texts in docs.items() for i in texts]
    wanted = {("web", "w-exact"), ("web", "w-chain-c")}  # the copy of a kept news document; the far end of a chain
    seed = next(s for s in range(100_000) if {n for n, d in zip(names, drawn(*map(list, zip(*names)), 0.2, s)) if d} == wanted)
    held_out = ["--set", "eval.fraction=0.2", "--set", f"eval.seed={seed}"]
    assert main(["--config", str(cfg), "--only", "normalize,dedup", *held_out]) == 0
    normalize = json.loads((root / "work" / "normalize" / "manifest.json").read_text())
    assert normalize["counts"]["eval"] == 2 and len(normalize["eval"]["fingerprint"]) == 16
    assert {r["id"] for r in rows(Path(normalize["output"]).parent / "eval")} == {"w-exact", "w-chain-c"}
    manifest = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    folder = Path(manifest["output"]).parent
    near = {r["id"]: r for r in rows(folder / "near_eval")}
    assert set(near) == {"n-exact", "n-chain-a", "w-chain-b", "n-chain-x"}
    assert near["n-exact"]["kept_id"] == "w-exact" and near["n-exact"]["kept_source"] == "web" and near["n-exact"]["overlap"] == 1.0
    assert near["n-chain-a"]["kept_id"] == near["w-chain-b"]["kept_id"] == near["n-chain-x"]["kept_id"] == "w-chain-c"
    assert 0.5 < near["n-chain-x"]["overlap"] < near["n-chain-a"]["overlap"] < near["w-chain-b"]["overlap"] < 1
    assert {r["id"] for r in rows(folder / "duplicates")} == {"w-space", "w-oneword", "w-self2"}
    assert {r["id"] for r in rows(folder / "output")} == {"n-space", "n-oneword", "n-edited", "w-edited", "n-unique", "w-self1"}
    assert manifest["counts"] == {"rows_in": 13, "rows_out": 6, "duplicate": 3, "near_eval": 4}
    assert manifest["metrics"]["near_eval.news"] == 3 and manifest["metrics"]["near_eval.web"] == 1
    assert manifest["metrics"]["decontaminate.eval_ngrams"] > 3000 and manifest["metrics"]["decontaminate.seconds"] > 0
    assert manifest["eval"] == normalize["eval"]  # passed on to the screen, which tags its proxy runs with it
    # A dedup ablation: normalize is a cache hit (the same set and fingerprint); the same documents leave as near_eval.
    assert main(["--config", str(cfg), "--only", "normalize,dedup", *held_out, "--set", "dedup.threshold=0.7"]) == 0
    ablation = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
    assert ablation["fingerprint"] != manifest["fingerprint"] and ablation["eval"] == normalize["eval"]
    assert json.loads((root / "work" / "normalize" / "manifest.json").read_text())["fingerprint"] == normalize["fingerprint"]
    assert rows(Path(ablation["output"]).parent / "near_eval") == rows(folder / "near_eval")
    assert ablation["counts"]["near_eval"] == 4
    # eval.decontaminate's settings are the evaluation set's too: another fingerprint, so compare.py keeps the runs apart.
    assert main(["--config", str(cfg), "--only", "normalize", *held_out, "--set", "eval.decontaminate.threshold=0.9"]) == 0
    stricter = json.loads((root / "work" / "normalize" / "manifest.json").read_text())
    assert stricter["eval"]["fingerprint"] != normalize["eval"]["fingerprint"]
    assert stricter["eval"]["decontaminate"] == {"ngram": 13, "threshold": 0.9} and stricter["counts"] == normalize["counts"]


def test_mlflow_has_the_counts_and_the_histogram(corpus, deduped):
    root, *_ = corpus
    manifest, _ = deduped
    client = MlflowClient(f"sqlite:///{root}/work/mlflow.db")
    run = client.get_run(manifest["mlflow_run_id"])
    assert run.data.metrics["duplicate"] == 6 and run.data.metrics["verified_pairs"] >= 5
    assert run.data.params["dedup.threshold"] == "0.95" and run.data.params["eval.decontaminate.ngram"] == "13"
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


def test_components_on_ray_data_are_the_one_task_components(ray_session):
    """Large-star/small-star rounds on Ray Data against min-label propagation in one task: a long chain
    in shuffled key order (the most rounds), stars, a clique and random sparse edges, on int64 keys. A node of more
    edges than the bound is starred without grouping its edges (dedup/heavy.py), with the same components."""
    import numpy as np
    import pyarrow as pa
    import ray.data

    from dedup.components import components_in_one_task, components_on_ray
    from core.ray_session import RayConfig

    rng = np.random.default_rng(0)
    names = rng.choice(1 << 40, size=3000, replace=False).astype(np.int64)  # keys as part << 32 | row, scattered
    edges = [(names[i], names[i + 1]) for i in range(400)]  # a chain of 401 documents in random key order
    edges += [(names[500], names[i]) for i in range(501, 560)]  # a star
    edges += [(names[i], names[j]) for i in range(600, 620) for j in range(i + 1, 620)]  # a clique
    edges += [tuple(names[rng.choice(np.arange(700, 3000), 2, replace=False)]) for _ in range(1500)]  # random sparse
    a, b = np.array([e[0] for e in edges]), np.array([e[1] for e in edges])
    u, v = np.maximum(a, b), np.minimum(a, b)
    expected = components_in_one_task(u, v)
    ds = ray.data.from_arrow(pa.table({"u": u, "v": v}))
    # A bound of 8: the star's centre, the clique's members and the chain's root in its last rounds (its 400 edges)
    # are starred by blocks, every other node in its group.
    labels, rounds, held = components_on_ray(ds, u.nbytes * 2, RayConfig(), partitions=3, bound=8)
    rows = labels.take_all()
    assert {r["node"]: r["root"] for r in rows} == expected
    assert len({(r["node"], r["root"]) for r in rows}) == len(expected)  # one root per node
    assert len(set(expected.values())) > 100 and expected[int(names[400])] == int(names[:401].min())
    assert 3 <= rounds <= 20 and 2 <= held <= 8, (rounds, held)


def test_a_global_aggregate_runs_on_the_sort_shuffle_with_the_same_values(ray_session):
    """core/ray_session.py `over_all`: the dataset's own context asks for the hash shuffle (as a dataset made by
    a large groupby does), yet the sum and max run without its aggregator actors (no HashAggregate in the plan
    Ray Data logs), with Ray Data's own values, and leave no thread behind."""
    import logging

    import pyarrow as pa
    import ray.data
    from ray.data.aggregate import Max, Sum
    from ray.data.context import ShuffleStrategy

    from core.ray_session import over_all

    class Plans(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.seen: list[str] = []

        def emit(self, record):
            if "Execution plan" in (message := record.getMessage()):
                self.seen.append(message)

    def dataset():
        ds = ray.data.from_arrow(pa.table({"held": list(range(300))})).repartition(6).materialize()
        ds.context.shuffle_strategy = ShuffleStrategy.HASH_SHUFFLE
        return ds

    logger, plans = logging.getLogger("ray.data"), Plans()
    logger.addHandler(plans)
    try:
        ours, theirs = dataset(), dataset()
        plans.seen.clear()
        threads = set(threading.enumerate())
        assert over_all(ours, Sum("held"), Max("held")) == {"sum(held)": sum(range(300)), "max(held)": 299}
        # No thread left behind holding blocks (dataset.aggregate's take(1) leaves its iterator's: issue #61)
        assert not set(threading.enumerate()) - threads, set(threading.enumerate()) - threads
        assert plans.seen and not any("HashAggregate" in p for p in plans.seen), plans.seen
        plans.seen.clear()
        assert theirs.max("held") == 299 and any("HashAggregate" in p for p in plans.seen), plans.seen  # what it avoids
    finally:
        logger.removeHandler(plans)
    empty = ray.data.from_arrow(pa.table({"held": pa.array([], pa.int64())}))
    assert over_all(empty, Max("held")) == {"max(held)": None}


def test_an_idle_task_worker_outlives_a_second_while_an_actor_holds_every_cpu(ray_session):
    """core/ray_session.py LOCAL_SYSTEM_CONFIG: Ray keeps idle workers only up to the CPUs that are free, and with its
    own settings ends the others a second after their last task. So while a Ray Train worker or a stage's own task
    held every CPU, each idle worker was ended, and the next task started a new process and its imports (24 processes
    for the hash-shuffle rerun's dedup on 1 CPU, 11 now). Here an actor holds both CPUs: the worker of the task before
    it still lives 3 s on."""
    import os
    import time

    import ray

    @ray.remote(num_cpus=1)
    def pid() -> int:
        return os.getpid()

    @ray.remote
    class Holder:
        def pid(self) -> int:
            return os.getpid()

    first = ray.get(pid.remote(), timeout=60)
    holder = Holder.options(num_cpus=ray.cluster_resources()["CPU"]).remote()
    try:  # the session's Ray is shared: its CPUs are given back whatever happens
        assert ray.get(holder.pid.remote(), timeout=60) != first and ray.available_resources().get("CPU", 0) == 0
        time.sleep(3)
        stat = Path(f"/proc/{first}/stat")  # this machine is the node
        assert stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # Ray's 1 s would have ended it
    finally:
        ray.kill(holder)


def test_heavy_keys_are_exactly_the_keys_over_the_bound_however_their_rows_spread(ray_session):
    """dedup/heavy.py against a count: keys over the bound spread thinly over many blocks (under the tally's floor in
    each) or packed in one, keys at the bound, and the rest; each heavy key with its smallest value."""
    import numpy as np
    import pyarrow as pa
    import ray.data

    from core.ray_session import RayConfig
    from dedup.heavy import heavy_keys
    from dedup.keys import Shuffles

    rng = np.random.default_rng(3)
    keys = np.concatenate([np.full(40, 7), np.full(40, 9), np.full(41, 11), np.full(60, 13), rng.integers(100, 10**6, 3000)])
    keys = keys[rng.permutation(len(keys))]  # 7 and 9: at the bound (40); 11 and 13 over it, spread over every block
    keys = np.concatenate([np.full(45, 5), keys])  # 5: over it, packed in the first block
    least = rng.integers(0, 10**9, len(keys))
    ds = ray.data.from_arrow(pa.table({"k": keys, "x": least})).repartition(16).materialize()
    heavy, smallest = heavy_keys(ds, lambda b: (b["k"].to_numpy(), b["x"].to_numpy()), 40, Shuffles(RayConfig()), "test")
    values, counts = np.unique(keys, return_counts=True)
    assert heavy.tolist() == values[counts > 40].tolist() and {5, 11, 13} <= set(heavy.tolist()), heavy
    assert smallest.tolist() == [int(least[keys == k].min()) for k in heavy]


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """A corpus with a cluster of 120 exact copies over two sources, a hot bucket (60 one-word edits of one
    text: a band bucket over SMALL_BUCKET), chains, and unrelated documents; with the brute-force truth."""
    import numpy as np

    from dedup.minhash import MinHasher, jaccard_of_sets

    root = tmp_path_factory.mktemp("crowded")
    rng = random.Random(7)
    base = [long_doc(100 + i, words=400) for i in range(8)]
    docs = {"news": {}, "web": {}}
    for i in range(120):  # exact copies; the kept one is news's smallest id
        docs["news" if i % 3 == 0 else "web"][f"copy-{rng.randrange(10**6):06d}-{i}"] = base[0]
    for i in range(60):  # one word each: all within 0.95 of base[1] and of each other
        docs["web" if i % 2 else "news"][f"hot-{i:03d}"] = edit(base[1], [rng.randrange(400)], 1000 + i)
    chain = [base[2]]
    for k in range(5):  # one word a link: each within the threshold of the next (~0.975), the ends not (~0.88)
        chain.append(edit(chain[-1], [50 + 60 * k], 2000 + k))
    for k, text in enumerate(chain):
        docs["web" if k % 2 else "news"][f"chain-{k}"] = text
    for i in range(3, 8):
        docs["web"][f"alone-{i}"] = base[i]
    for name, texts in docs.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    cfg = write_config(root, f"""
workdir: {root}/work
eval: {{fraction: 0}}   # every document reaches dedup, as in the brute-force truth
dedup: {{task_documents: 16}}  # the 120 copies' component assembled over 8 tasks, the 60 hot documents verified over 4
sources:
  - {{name: news, format: jsonl, id_field: id, paths: ["{root}/news.jsonl"]}}
  - {{name: web,  format: jsonl, id_field: id, paths: ["{root}/web.jsonl"]}}
""")
    # The truth: components of every pair at or above 0.95 (brute force), each kept at its (source, id) minimum.
    flat = [(i, s, t) for s, texts in docs.items() for i, t in texts.items()]
    sets = MinHasher().shingle_sets([t for _, _, t in flat])
    parent = list(range(len(flat)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x in range(len(flat)):
        for y in range(x + 1, len(flat)):
            if jaccard_of_sets(sets[x], sets[y]) >= 0.95:
                parent[find(x)] = find(y)
    order = {"news": 0, "web": 1}
    groups: dict = {}
    for x in range(len(flat)):
        groups.setdefault(find(x), []).append(x)
    truth = {}
    for members in groups.values():
        keep = min(members, key=lambda x: (order[flat[x][1]], flat[x][0]))
        truth.update({flat[x][0]: flat[keep][0] for x in members if x != keep})
    assert len(truth) == 119 + 59 + 5 and np.mean([len(s) for s in sets]) > 350
    return root, cfg, truth


def test_exact_copies_a_hot_bucket_and_chains_merge_as_brute_force_does_with_either_components_path(crowded, ray_session,
                                                                                                    monkeypatch):
    """The kept documents and `duplicates/` of the one-task components and of the Ray Data rounds are the same,
    and both are the brute-force truth; the exact copies never reach MinHash. On Ray Data a component of more than
    `task_documents` is assembled over several tasks (its 120 copies, 16 a task), with the one task's result."""
    import dedup.assemble

    root, cfg, truth = crowded
    results = []
    for one_task_edges in (1 << 20, 0):  # every edge in one task (its ~200 are over 4 x 16), then none
        monkeypatch.setattr(dedup.assemble, "EDGES_PER_TASK_DOCUMENT", one_task_edges)
        assert main(["--config", str(cfg), "--only", "ingest,normalize,dedup", "--force"]) == 0
        manifest = json.loads((root / "work" / "dedup" / "manifest.json").read_text())
        folder = Path(manifest["output"]).parent
        dups = sorted(tuple(sorted(r.items())) for r in rows(folder / "duplicates"))
        results.append((manifest["metrics"], dups, sorted(r["id"] for r in rows(folder / "output")),
                        json.loads((folder / "cluster_sizes.json").read_text())))
    (one, dups_one, kept_one, sizes_one), (rounds, dups_ray, kept_ray, sizes_ray) = results
    assert dups_one == dups_ray and kept_one == kept_ray and sizes_one == sizes_ray and sizes_one["120"] == 1
    # No task grouped more than `task_documents` of one key: the 120 copies' text, the 60 edits' buckets (over
    # SMALL_BUCKET: 32), the component's root; each was a heavy key, handled by blocks (dedup/heavy.py).
    assert max(one["largest_key_rows.exact"], rounds["largest_key_rows.exact"], rounds["largest_key_rows.components"]) <= 16
    assert 1 <= max(one["largest_key_rows.candidates"], rounds["largest_key_rows.candidates"]) <= 32
    assert one["largest_task_documents.assembly"] == 183 + 3  # one task: every document of the 3 components
    assert rounds["largest_task_documents.assembly"] < 120, rounds  # was the whole component (assemble_components)
    assert {dict(r)["id"]: dict(r)["kept_id"] for r in dups_one} == truth
    exact = [dict(r) for r in dups_one if dict(r)["id"].startswith("copy-")]
    kept_copy = truth[exact[0]["id"]]
    assert len(exact) == 119 and all(r["jaccard"] == 1.0 and r["via"] == kept_copy for r in exact)
    assert one["exact_duplicates"] == 119 and one["rounds"] == 0 and rounds["rounds"] >= 1
    assert one["lsh_threshold"] == pytest.approx((1 - 0.5 ** (1 / 10)) ** (1 / 12), abs=1e-4)
    assert 0 < one["candidate_documents_fraction"] < 0.5  # the copies are not candidates: one text, one document
    assert one["verified_pairs"] >= 119 + 59 + 5 and one["shuffled_bytes.exact"] > 0
    # No text in the shuffles: all phases together move less than the corpus's text once (the code before
    # issue 19 sent every text through two groupbys), though pairs cross the two sources' parts.
    text = sum(len(json.loads(line)["text"].encode()) for f in ("news", "web") for line in (root / f"{f}.jsonl").open())
    for metrics in (one, rounds):
        assert metrics["shuffled_bytes.verification"] > 0
        assert sum(v for k, v in metrics.items() if k.startswith("shuffled_bytes.")) < text


def test_a_hot_cluster_is_verified_in_bounded_tasks_and_keeps_one_document(tmp_path, ray_session):
    """2,000 one-word edits of one text share a MinHash bucket in most bands: a bucket over SMALL_BUCKET pairs its
    smallest document with every other. Verified in the units of their second documents, 50 rows each
    (`dedup.task_documents`), no task holds more than its unit and their partners in 10 bands (the bucket's
    smallest document, each one's neighbour in key order, the few that share a small bucket: 282 here), where
    the first document's part (the rule before) held all 2,000 in one task; no task groups a whole bucket (the
    rule before grouped each of ~1,750); and the cluster keeps one document, by the same rule as before."""
    base, rng = long_doc(500, words=1000), random.Random(11)
    docs = {f"hot-{i:04d}": edit(base, [rng.randrange(1000)], 5000 + i) for i in range(2000)}
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    cfg = write_config(tmp_path, f"""
workdir: {tmp_path}/work
eval: {{fraction: 0}}
dedup: {{task_documents: 50}}
sources:
  - {{name: web, format: jsonl, id_field: id, paths: ["{tmp_path}/web.jsonl"]}}
""")
    assert main(["--config", str(cfg), "--only", "ingest,normalize,dedup"]) == 0
    manifest = json.loads((tmp_path / "work" / "dedup" / "manifest.json").read_text())
    folder = Path(manifest["output"]).parent
    assert [r["id"] for r in rows(folder / "output")] == ["hot-0000"]
    dups = rows(folder / "duplicates")
    assert len(dups) == 1999 and {d["kept_id"] for d in dups} == {"hot-0000"} and min(d["jaccard"] for d in dups) >= 0.95
    held = manifest["metrics"]["largest_task_documents.verification"]
    assert 50 <= held <= 500, held
    # Its buckets (~1,750 documents each) were never grouped whole: their pairs were made 50 keys a task.
    assert 2 <= manifest["metrics"]["largest_key_rows.candidates"] <= 50, manifest["metrics"]


def test_a_parts_tasks_hold_a_row_group_of_it_however_big_the_part(tmp_path):
    """The exact and candidates phases' per-part tasks (index_task, band_task) read a part a row group at a time
    and hash its text a chunk at a time, so what they hold does not grow with the part: a part of 200 one-word
    edits of a 1,000-word text and one of 2,000 (10x the text, 11 MB more), in row groups of 128 documents.
    Python's traced peak (numpy's arrays and the strings) may grow by a quarter of that; hashing a whole part at
    once, as before, it grew 290 MB. The band rows are those of the whole part's signatures at once, and the
    index has every document once."""
    import tracemalloc

    import numpy as np
    import pyarrow as pa

    from dedup.candidates import BandTask, band_task
    from dedup.config import DedupConfig
    from dedup.exact import IndexTask, index_task
    from dedup.keys import hasher
    from dedup.lsh import band_keys, choose_banding

    cfg, none = DedupConfig(), str(tmp_path / "nothing-removed")
    bands, rows_ = choose_banding(cfg.num_perm, cfg.threshold)
    base, rng = long_doc(500, words=1000), random.Random(11)
    peaks, text = {}, {}
    for n in (200, 2000):
        docs = [edit(base, [rng.randrange(1000)], 9000 + i) for i in range(n)]
        text[n] = sum(map(len, docs))
        path = tmp_path / f"part-{n}.parquet"
        pq.write_table(pa.table({"id": [f"hot-{i:05d}" for i in range(n)], "source": ["web"] * n, "text": docs}), path,
                       row_group_size=128)
        tasks = {"bands": (band_task, BandTask(str(path), 3, str(tmp_path / f"bands-{n}"), 4, none, cfg, bands, rows_, none)),
                 "index": (index_task, IndexTask(str(path), 3, str(tmp_path / f"index-{n}"), 4, none, {"web": 0}))}
        for name, (run, task) in tasks.items():
            tracemalloc.start()
            run(task)
            peaks[name, n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        written = pq.read_table(tmp_path / f"bands-{n}" / "bands-00003.parquet")
        whole = band_keys(hasher(cfg).signatures(docs), bands, rows_, seed=cfg.seed).ravel()
        assert written["band"].to_numpy().tolist() == whole.tolist()
        assert written["key"].to_numpy().tolist() == np.repeat((3 << 32) + np.arange(n), bands).tolist()
        index = pq.read_table(tmp_path / f"index-{n}" / "index-00003.parquet")
        assert index["id"].to_pylist() == [f"hot-{i:05d}" for i in range(n)] and index["key"][-1].as_py() == (3 << 32) + n - 1
    for name in ("bands", "index"):
        assert peaks[name, 2000] - peaks[name, 200] < (text[2000] - text[200]) / 4, (name, peaks, text)


def test_verification_holds_arrays_not_an_object_per_pair(tmp_path, monkeypatch):
    """A unit of a hot cluster has many pairs per document (up to 2 x bands). `verify` holds a few arrays per pair
    beside its documents' shingle sets: under 120 bytes a pair of Python's traced memory past the part's read (a
    tuple per pair, as before: about 360). Its rows are each pair's brute-force Jaccard, (a, b) in (id, source)
    order, for documents of its own part and for those another part sends (as `shingle_rows` sends them)."""
    import tracemalloc

    import numpy as np
    import pyarrow as pa

    from dedup import verify as v
    from dedup.config import DedupConfig
    from dedup.keys import hasher
    from dedup.minhash import jaccard_of_sets

    cfg, rng, n, away = DedupConfig(), random.Random(5), 1200, 40
    base = long_doc(501, words=500)
    docs = [edit(base, rng.sample(range(500), rng.choice([1, 1, 8])), 7000 + i) for i in range(n + away)]  # 8 words: below 0.95
    ids = [f"hot-{n - i:05d}" for i in range(n)] + [f"away-{i:03d}" for i in range(away)]  # ids run against the keys
    path = tmp_path / "part-1.parquet"
    pq.write_table(pa.table({"id": ids[:n], "source": ["web"] * n, "text": docs[:n]}), path, row_group_size=256)
    keys = [(1 << 32) + i for i in range(n)] + list(range(away))  # the sent documents are part 0's
    sets = hasher(cfg).shingle_sets(docs)
    pairs = sorted({(keys[rng.randrange(j) if rng.random() < 0.9 else n + rng.randrange(away)], keys[j])
                    for j in range(1, n) for _ in range(12)})
    sent = sorted({a for a, _ in pairs if a < (1 << 32)})
    pair_rows = v.pairs_keyed(pa.table({"a_key": [a for a, _ in pairs], "b_key": [b for _, b in pairs]}), cfg.task_documents)
    doc_rows = pa.table({"part": [1 << 32] * len(sent), "kind": ["doc"] * len(sent), "a_key": sent,
                         "b_key": pa.nulls(len(sent), pa.int64()),
                         "id": [ids[n + k] for k in sent], "source": ["news"] * len(sent),
                         "shingles": v.binary_of([sets[n + k] for k in sent]), "first": [1] * len(sent)}, schema=v.JOIN_SCHEMA)
    read = v.read_documents
    after_read = []

    def measured_read(*args):
        out = read(*args)
        after_read.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.reset_peak()
        return out

    monkeypatch.setattr(v, "read_documents", measured_read)
    tracemalloc.start()
    checked = v.verify(pa.concat_tables([pair_rows, doc_rows]), [str(tmp_path / "unused"), str(path)], cfg)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (peak - after_read[0]) / len(pairs) < 120, (peak - after_read[0]) / len(pairs)
    place = {k: i for i, k in enumerate(keys)}
    source = {k: "web" if k >= 1 << 32 else "news" for k in keys}
    truth = []
    for a, b in pairs:
        (a_id, a_src, a), (b_id, b_src, b) = sorted([(ids[place[a]], source[a], a), (ids[place[b]], source[b], b)])
        truth.append((a_id, b_id, a_src, b_src, jaccard_of_sets(sets[place[a]], sets[place[b]]), a, b, n + len(sent)))
    assert sorted(zip(*[checked[c].to_pylist() for c in v.VERIFIED_SCHEMA.names])) == sorted(truth)
    assert len(truth) > 10_000 and 0 < sum(r[4] < 0.95 for r in truth) < len(truth)  # both sides of the threshold
    assert np.unique([v.sets_of(doc_rows["shingles"])[i].sum() for i in range(len(sent))]).size > 1
