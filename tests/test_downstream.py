"""Downstream tasks through lm-evaluation-harness (train/downstream/): the held-out continuation task made from the
evaluation set and scored on every seed's export, its accuracy in MLflow, lm-eval's output in the stage log only;
task names checked at load as lm-eval knows them; nothing of the (shared) workdir imported or run as code."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import manifest, write_config
from core.config import ConfigError
from core.dag import Stage, StageContext, StageResult
from pipelines.config import load_config
from corpus import lm_eval_names as names
from train.downstream import heldout, stage

TASK = heldout.NAME
WORDS = ("the river ran past an old stone house where morning light fell on green fields and a dog slept "
         "while children sang of distant cities under blue skies").split()


def documents(n: int = 60, seed: int = 0) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    return [(f"src{i % 3}", f"doc{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))))
            for i in range(n)]


# --------------------------------------------------------------------------- the task's data


def test_the_heldout_task_is_seeded_fair_and_made_of_the_documents_own_continuations():
    docs = documents()
    made = heldout.examples(docs, seed=0)
    assert made == heldout.examples(list(reversed(docs)), seed=0)  # the documents' order does not matter
    assert made != heldout.examples(docs, seed=1)
    text = {f"{s}/{i}": t for s, i, t in docs}
    for example in made:
        source, doc_id, place = example["id"].rsplit("/", 2)
        own = text[f"{source}/{doc_id}"]
        end = heldout.CONTEXT_CHARS + int(place) * heldout.STRIDE
        assert example["context"] == own[end - heldout.CONTEXT_CHARS:end]
        assert example["choices"][example["label"]] == own[end:end + heldout.CONTINUATION_CHARS]
        assert len(example["choices"]) == heldout.CHOICES == len(set(example["choices"]))
        assert {len(c) for c in example["choices"]} == {heldout.CONTINUATION_CHARS}  # acc and acc_norm agree
    assert len({e["label"] for e in made}) == heldout.CHOICES  # the answer is not always in one place
    assert len(made) == sum(len(heldout.places(t)) for _, _, t in docs)
    with pytest.raises(ValueError, match="fewer than the 4 choices"):
        heldout.examples(docs[:3], seed=0)


# --------------------------------------------------------------------------- task names at config load


def test_an_unknown_task_is_a_config_error_naming_it(capsys):
    from pipelines.full import main

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["eval.downstream.tasks=[heldout_continuation, hellaswag, hellaswg]"])
    assert caught.value.key == "eval.downstream.tasks[2]"
    assert "unknown task 'hellaswg'" in str(caught.value) and names.lm_eval_version() in str(caught.value)
    assert main(["--set", "eval.downstream.tasks=[no_such_task]"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: config key 'eval.downstream.tasks[0]': unknown task 'no_such_task': neither ours (heldout_continuation) "
        f"nor a task, group or tag of lm-eval {names.lm_eval_version()} (`lm_eval --tasks list`)"]
    for name in ("piqa", "arc_easy", "storycloze", "super-glue-lm-eval-v1", "mmlu"):  # a task, tags, a group
        assert load_config(None, [f"eval.downstream.tasks=[{name}]"]).eval.downstream.tasks == [name]


def test_the_names_read_as_text_are_every_name_lm_evals_own_index_has():
    """What the config check reads without lm-eval (names.scan) against lm-eval's TaskManager index: nothing that
    lm-eval would run is refused at load."""
    from lm_eval.tasks._index import TaskIndex

    indexed = set(TaskIndex.build([names.lm_eval_tasks()]))
    assert len(indexed) > 10_000 and indexed <= names.scan(names.lm_eval_tasks())


def test_the_configs_name_tasks_lm_eval_has():
    root = Path(__file__).resolve().parents[1] / "configs"
    assert load_config(root / "local.yaml").eval.downstream.tasks == [TASK]
    for name in ("opt-125m", "opt-1.3b", "opt-175b"):
        tasks = load_config(root / f"{name}.yaml").eval.downstream.tasks
        assert {"hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "boolq", "copa"} <= set(tasks)


def test_a_new_task_list_reruns_the_downstream_stage():
    from core.dag import fingerprints
    from pipelines.stages import STAGES

    base = fingerprints(load_config(None), list(STAGES))
    for change in ("eval.downstream.limit=10", "eval.downstream.tasks=[piqa]"):
        assert fingerprints(load_config(None, [change]), list(STAGES))["downstream"] != base["downstream"], change


def test_a_new_task_list_changes_only_the_downstream_stage():
    from core.dag import fingerprints
    from pipelines.stages import STAGES

    base = fingerprints(load_config(None), list(STAGES))
    other = fingerprints(load_config(None, ["eval.downstream.limit=10"]), list(STAGES))
    assert [s for s in base if base[s] != other[s]] == ["downstream"]


# --------------------------------------------------------------------------- nothing of the workdir becomes code


def workdir_request(work: Path) -> stage.Request:
    """Our task as the stage leaves it in the (shared) workdir's tasks/, its YAML and data, and a request of no
    models: the harness starts, reads its request and indexes the tasks, then has nothing to evaluate."""
    tasks = work / "tasks"
    tasks.mkdir(parents=True)
    shutil.copyfile(names.ours()[TASK], tasks / names.ours()[TASK].name)
    heldout.write(documents(), 0, tasks / f"{TASK}.jsonl")
    return stage.Request(models=(), tasks=(TASK,), include_path=str(tasks), include_defaults=False, offline=True,
                         limit=2, num_fewshot=0, batch_size=1, dtype="float32", device="cpu", parallelize=False,
                         threads=1, seed=0, out=str(work))


def test_a_module_planted_in_the_workdir_is_not_imported_by_the_harness(tmp_path):
    """`python -m` from the task folder put it first on sys.path: a `json.py` there ran (exit 42)."""
    request = workdir_request(tmp_path / "work")
    planted = tmp_path / "ran"
    (Path(request.include_path) / "json.py").write_text(f"open({str(planted)!r}, 'w').close()\nraise SystemExit(42)\n")
    code, output = stage.evaluate(request)
    assert code == 0 and not planted.exists(), output[-2000:]


def test_the_harness_runs_in_a_private_folder_with_its_request_on_stdin(tmp_path, monkeypatch):
    """Not in the workdir, nor from a request file there: a private folder (0700) of copies of our task files, gone
    after; -P, so the folder it runs in is not on sys.path. A rank's variables stay behind: the harness is one
    process (a Ray worker started from a rank of a gloo group handed them on, and lm-eval asked for MASTER_ADDR)."""
    request = workdir_request(tmp_path / "work")
    seen = {}
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)

    def harness(args, **kwargs):
        folder = Path(kwargs["cwd"])
        seen.update(args=args, stdin=kwargs.get("input"), folder=folder, mode=folder.parent.stat().st_mode & 0o777,
                    files=sorted(p.name for p in folder.iterdir()), env=kwargs["env"])
        return subprocess.CompletedProcess(args, 0, "")

    monkeypatch.setattr(stage.subprocess, "run", harness)
    assert stage.evaluate(request) == (0, "")
    assert seen["args"][1:] == ["-P", "-m", "train.downstream.harness"]  # no request file named
    assert not set(stage.RANK_VARIABLES) & set(seen["env"]) and seen["env"]["PATH"] == os.environ["PATH"]
    assert tmp_path not in seen["folder"].parents and seen["mode"] == 0o700 and not seen["folder"].exists()
    assert seen["files"] == sorted([f"{TASK}.jsonl", names.ours()[TASK].name])
    assert json.loads(seen["stdin"]) == {**json.loads(json.dumps(vars(request))), "include_path": str(seen["folder"])}


def test_a_task_file_that_is_not_ours_is_refused_before_the_harness_starts(tmp_path, monkeypatch):
    """A `!function` in a task YAML runs the Python it names (a file beside it, or any module): only the YAML we ship
    is run, and a link in place of a task file is refused, not followed."""
    request = workdir_request(tmp_path / "work")
    monkeypatch.setattr(stage.subprocess, "run", lambda *a, **k: pytest.fail("the harness started"))
    yaml_file = Path(request.include_path) / names.ours()[TASK].name
    shipped = yaml_file.read_text()
    assert "!function" not in "".join(p.read_text() for p in names.ours().values())  # ours need none
    (yaml_file.parent / "evil.py").write_text("def process(doc, results):\n    raise SystemExit(42)\n")
    yaml_file.write_text(shipped + "process_results: !function evil.process\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(yaml_file))} is not our task file .*: refused, .*`!function`"):
        stage.evaluate(request)
    yaml_file.write_text(shipped)
    data = Path(request.include_path) / f"{TASK}.jsonl"
    data.unlink()
    data.symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_text("token\n")
    with pytest.raises(OSError):
        stage.evaluate(request)


# --------------------------------------------------------------------------- the stage, on a tiny export


def fake_normalize(ctx: StageContext) -> StageResult:
    """The evaluation set as normalize sets it aside (eval/), nothing else."""
    docs = documents()
    table = pa.table({"id": [d[1] for d in docs], "text": [d[2] for d in docs], "source": [d[0] for d in docs],
                      "subset": [""] * len(docs), "meta": ["{}"] * len(docs)})
    pq.write_table(table, ctx.aside("eval") / "part-0000.parquet")
    return StageResult(len(docs), 0, {"eval": len(docs)})


def fake_train(ctx: StageContext) -> StageResult:
    """Two seeds' exports where the train stage puts them (train/stage.py export_dir): an untrained tiny OPT each,
    with a tokenizer trained on the evaluation set's words."""
    import torch

    from corpus import tokenizer
    from model.configs import get
    from model.hf import save_pretrained
    from model.opt import OPT
    from train.stage import export_dir

    tok = tokenizer.train([d[2] for d in documents()], vocab_size=300)
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_pretrained(OPT(get("tiny")), export_dir(ctx.output, seed, 0), save_tokenizer=partial(tokenizer.save, tok))
    return StageResult(1, 1, fields={"seeds": [0, 1]}, tags={"eval.fingerprint": "e" * 16, "data.fingerprint": "d" * 16})


def test_the_heldout_task_runs_through_lm_eval_on_each_seeds_export_and_reaches_mlflow(tmp_path, ray_session, capsys):
    from pipelines.full import main
    from pipelines.stages import STAGES

    (tmp_path / "raw.jsonl").write_text('{"text": "unused"}\n')
    cfg = write_config(tmp_path, f"""
sources: [{{name: raw, format: jsonl, paths: ["{tmp_path}/raw.jsonl"]}}]
workdir: {tmp_path}/work
eval: {{downstream: {{tasks: [{TASK}], limit: 20, batch_size: 8}}}}
""")
    stages = (Stage("normalize", (), "eval", fake_normalize, code=("test_downstream",)),
              Stage("train", ("normalize",), "train", fake_train, code=("test_downstream",)),
              next(s for s in STAGES if s.name == "downstream"))
    assert main(["--config", str(cfg)], stages=stages) == 0
    out = capsys.readouterr()
    assert "lm_eval" not in out.out + out.err and "|acc" not in out.out + out.err  # lm-eval's output: in the log
    work = tmp_path / "work"
    made = manifest(work, "downstream")
    folder = Path(made["output"])
    log = (folder.parent / "stage.log").read_text()
    seed1 = log[log.index(f"lm-eval: == seed 1: {Path(manifest(work, 'train')['output']) / 'seed-1' / 'model'}"):]
    assert re.search(rf"lm-eval: \|{TASK}\s*\|\s*1\|none\s*\|\s*0\|acc\s*\|", seed1), log[-3000:]
    assert (folder / "tasks" / f"{TASK}.jsonl").read_text().count("\n") == len(heldout.examples(documents(), 0))

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    run = client.get_run(made["mlflow_run_id"])
    for seed in (0, 1):
        acc = run.data.metrics[f"seed{seed}/downstream.{TASK}"]
        assert 0.0 <= acc <= 1.0
        results = json.loads((folder / f"seed-{seed}" / "results.json").read_text())
        assert results["results"][TASK]["acc,none"] == acc and results["n-samples"][TASK]["effective"] == 20
    assert run.data.metrics[f"downstream.{TASK}.examples"] == 20
    assert {k: run.data.tags[k] for k in ("downstream.seeds", "downstream.tasks", f"downstream.{TASK}.metric",
                                          "eval.fingerprint", "data.fingerprint")} == {
        "downstream.seeds": "0,1", "downstream.tasks": TASK, f"downstream.{TASK}.metric": "acc",
        "eval.fingerprint": "e" * 16, "data.fingerprint": "d" * 16}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "seed-1")} == {"seed-1/results.json"}


# --------------------------------------------------------------------------- the README's run


def test_the_default_run_scores_every_seeds_model_above_chance(default_run):
    """`python pipelines/full.py`: the tiny model picks the held-out continuation well above chance (0.25) on every
    seed (0.60-0.615 when this was written, with 2 seeds of 200 steps and with 4 of 100), each seed's export its own."""
    made, train = default_run.manifests["downstream"], default_run.manifests["train"]
    seeds = train["seeds"]
    assert len(seeds) > 1 and [(Path(train["output"]) / ("model" if s == seeds[0] else f"seed-{s}/model") /
                                "config.json").is_file() for s in seeds] == [True] * len(seeds)
    run = MlflowClient(f"sqlite:///{default_run.where}/work/mlflow.db").get_run(made["mlflow_run_id"])
    assert run.data.tags["downstream.seeds"] == ",".join(map(str, seeds))
    accuracy = [run.data.metrics[f"seed{s}/downstream.{TASK}"] for s in seeds]
    assert all(a > 0.4 for a in accuracy) and len(set(accuracy)) > 1, accuracy  # above chance, and models of their own
    assert run.data.metrics[f"downstream.{TASK}.examples"] == 200
