"""Config loading: every shipped config is valid; every kind of mistake names its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_config
from pipelines import config as ground
from core.config import ConfigError
from corpus.config import OPT_PILE_SUBSETS
from pipelines.config import check_inputs_exist
from pipelines.full import main
from pipelines.config import CHECKS

MINI = 'sources: [{name: a, format: jsonl, paths: ["raw/*.jsonl"]}]\n'



def load_config(path, overrides=(), workdir=None):
    """As a run loads a config: with the checks that need the model's sizes or the GPU tables (train/rules.py)."""
    return ground.load_config(path, overrides, workdir, checks=CHECKS)


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "x.jsonl").write_text('{"text": "hi"}\n')
    written = []

    def write(text: str = "") -> Path:
        written.append(text)
        return write_config(tmp_path, MINI + text, name=f"test{len(written)}")

    return write


@pytest.mark.parametrize("name", ["local", "opt-125m", "opt-1.3b", "opt-175b"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert config.name == name and config.mlflow.experiment == name
    assert [s.name for s in config.sources] == ["pile", "reddit", "bookcorpus", "stories", "ccnews"]


def test_real_run_configs_match_opt_table_1():
    big = load_config(ROOT / "configs" / "opt-175b.yaml")
    assert (big.train.model, big.train.zero_stage, big.train.precision, big.train.num_workers) == ("175b", 1, "fp16", 992)
    assert (big.train.parallel.tensor, big.train.parallel.pipeline, big.train.data_parallel) == (8, 4, 31)
    # OPT's "2M tokens": 992 sequences of 2048, the batch that splits over 31 data-parallel replicas x 32 micro-batches.
    assert big.train.lr == 1.2e-4 and big.train.global_batch_tokens == 992 * 2048
    assert big.tokenize.seq_len == 2048 and big.tokenize.tokenizer.vocab_size == 50272
    assert load_config(ROOT / "configs" / "opt-1.3b.yaml").train.lr == 2.0e-4


def test_defaults_and_resolved_paths(cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(cfg())
    assert config.workdir == str(tmp_path / "work")
    assert config.sources[0].paths == [str(tmp_path / "raw" / "*.jsonl")]
    assert config.mlflow.tracking_uri == f"sqlite:///{tmp_path}/work/mlflow.db"
    assert config.dedup.threshold == 0.95
    assert (config.eval.decontaminate.ngram, config.eval.decontaminate.threshold) == (13, 0.5)
    check_inputs_exist(config)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.0.5:5000")  # set on a cluster's head node
    assert load_config(cfg()).mlflow.tracking_uri == "http://10.0.0.5:5000"
    assert load_config(cfg("mlflow: {tracking_uri: sqlite:////x/m.db}\n")).mlflow.tracking_uri == "sqlite:////x/m.db"


@pytest.mark.parametrize("text, key, expected", [
    ("dedup: {treshold: 0.9}\n", "dedup.treshold", "unknown key; expected one of: threshold"),
    ("dedup: {threshold: high}\n", "dedup.threshold", "expected a number, got 'high' (str)"),
    ("dedup: {threshold: 1.5}\n", "dedup.threshold", "expected a Jaccard similarity in (0, 1]"),
    ("dedup: {ngram: 2.5}\n", "dedup.ngram", "expected an integer, got 2.5"),
    ("dedup: 7\n", "dedup", "expected a mapping, got 7 (int)"),
    ("dedup: {bands: 10}\n", "dedup.rows", "set bands and rows together"),
    ("dedup: {bands: 10, rows: 13}\n", "dedup.bands", "10 bands x 13 rows needs more than num_perm=128"),
    ("train: {precision: fp8}\n", "train.precision", "expected one of 'fp32', 'bf16', 'fp16'"),
    ("train: {zero_stage: 4}\n", "train.zero_stage", "expected 0, 1, 2, 3 or auto"),
    ("train: {compile: true, zero_stage: 3}\n", "train.compile", "compiled blocks take tensor and pipeline 1 and zero_stage 0 to 2"),
    ("train: {compile: true, num_workers: 2, parallel: {tensor: 2}}\n", "train.compile", "compiled blocks take tensor"),
    ("train: {max_steps: yes}\n", "train.max_steps", "expected an integer or null, got True (bool)"),
    ("normalize: {ftfy: 1}\n", "normalize.ftfy", "expected true or false"),
    ("tokenize: {tokenizer: {kind: gpt2}}\n", "tokenize.tokenizer.vocab", "required when kind is 'gpt2'"),
    ("tokenize: {tokenizer: {fairseq_dict: d.txt}}\n", "tokenize.tokenizer.fairseq_dict", "only read when kind is 'gpt2'"),
    ("tokenize: {tokenizer: {train_bytes: 0}}\n", "tokenize.tokenizer.train_bytes", "expected a value >= 1"),
    ("eval: {fraction: 1}\n", "eval.fraction", "expected a fraction in [0, 1)"),
    ("eval: {decontaminate: {ngram: 0}}\n", "eval.decontaminate.ngram", "expected a value >= 1, got 0"),
    ("eval: {decontaminate: {threshold: 0}}\n", "eval.decontaminate.threshold", "expected a fraction of n-grams in (0, 1], got 0"),
    ("eval: {decontaminate: {threshold: 1.5}}\n", "eval.decontaminate.threshold", "expected a fraction of n-grams in (0, 1]"),
    ("eval: {decontaminate: {treshold: 0.5}}\n", "eval.decontaminate.treshold", "unknown key; expected one of: ngram, threshold"),
    ("eval: {decontaminate: 13}\n", "eval.decontaminate", "expected a mapping"),
    ("train: {seeds: 0}\n", "train.seeds", "expected a value >= 1"),
    ("colour: blue\n", "colour", "unknown key"),
    ("sample_spiky_subset: Enron Emails\n", "sample_spiky_subset", "expected one of OPT's Pile subsets (the ones the "
     "screen screens): Pile-CC, "),
    ("train: {model: 7b}\n", "train.model", "expected one of tiny, 125m"),
    ("train: {precision: fp16}\n", "train.precision", "fp16 needs GPUs"),
    ("train: {collective_timeout_seconds: 600}\n", "train.collective_timeout_seconds",
     "expected more than hang_seconds and startup_seconds (3600)"),
    ("train: {max_failures: -2}\n", "train.max_failures", "expected a value >= -1"),
    ("train: {eval_micro_batch_size: 0}\n", "train.eval_micro_batch_size", "expected a value >= 1"),
    ("train: {inject: [{kind: spike, step: 0}]}\n", "train.inject[0].step", "expected a value >= 1"),
    ("train: {global_batch_tokens: 6144, micro_batch_size: 2}\n", "train.global_batch_tokens",
     "6144 tokens are 3 sequences of tokenize.seq_len=2048: not a multiple of micro_batch_size x num_workers / (parallel.tensor x parallel.pipeline) = 4"),
    ("train: {inject: [{kind: explode, step: 3}]}\n", "train.inject[0].kind", "expected one of 'kill', 'hang'"),
    ("train: {inject: [{kind: kill, step: 3, rank: 2}]}\n", "train.inject[0].rank", "expected a rank below num_workers=2"),
    ("train: {inject: [{kind: unhealthy, step: 0}]}\n", "train.inject[0].node", "an unhealthy fault names its node"),
    ("train: {inject: [{kind: lost, step: 3}]}\n", "train.inject[0].node", "a lost fault names its node"),
    ("train: {num_workers: 2, elastic: {enabled: true, min_replicas: 3}}\n", "train.elastic.min_replicas",
     "at most the run's 2 data-parallel replicas"),
    ("train: {num_workers: 4, parallel: {tensor: 2}, elastic: {enabled: true, min_replicas: 3}}\n",
     "train.elastic.min_replicas", "at most the run's 2 data-parallel replicas"),  # replicas of tensor x pipeline
    ("train: {elastic: {enabled: true, replacement_wait_seconds: 4000}}\n", "train.elastic.replacement_wait_seconds",
     "expected less than startup_seconds"),
    ("train: {inject: [{kind: slow, step: 1, factor: 0.5}]}\n", "train.inject[0].factor", "expected a number over 1"),
    ("train: {parallel: {tensor: 0}}\n", "train.parallel.tensor", "expected a value >= 1"),
    ("train: {num_workers: 3, parallel: {tensor: 2}}\n", "train.parallel.tensor", "2 does not divide num_workers=3"),
    ("train: {num_workers: 3, parallel: {tensor: 3}}\n", "train.parallel.tensor", "does not divide the tiny model's n_head (4)"),
    ("train: {model: 1.3b, num_workers: 16, gpus_per_worker: 1, precision: bf16, parallel: {tensor: 16}}\n", "train.parallel.tensor",
     "would span nodes of 8 GPUs"),
    ("train: {num_workers: 2, zero_stage: 3, parallel: {tensor: 2}}\n", "train.parallel.tensor", "takes ZeRO 0-2 here"),
    ("train: {model: 30b, num_workers: 8, gpus_per_worker: 1, precision: bf16, parallel: {tensor: 8}}\n",
     "train.parallel.pipeline", "up to 20B parameters, and 30b has 30.0B: each worker builds the whole model in fp32"),
    ("train: {parallel: {pipeline: 0}}\n", "train.parallel.pipeline", "expected a value >= 1"),
    ("train: {num_workers: 6, zero_stage: 1, parallel: {tensor: 2, pipeline: 2}}\n", "train.parallel.pipeline",
     "tensor 2 x pipeline 2 does not divide num_workers=6"),
    ("train: {num_workers: 4, zero_stage: 1, parallel: {pipeline: 4}}\n", "train.parallel.pipeline",
     "4 stages for the tiny model's 2 layers: every stage needs at least one"),
    ("train: {num_workers: 2, zero_stage: 2, parallel: {pipeline: 2}}\n", "train.parallel.pipeline",
     "pipeline parallelism takes zero_stage 1, got 2: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3"),
    ("train: {num_workers: 2, zero_stage: 0, parallel: {pipeline: 2}}\n", "train.parallel.pipeline",
     "under ZeRO-0 it reports no gradient norm"),
    ("train: {num_workers: 4, zero_stage: 1, micro_batch_size: 2, global_batch_tokens: 6144, parallel: {pipeline: 2}}\n",
     "train.global_batch_tokens", "micro_batch_size x num_workers / (parallel.tensor x parallel.pipeline) = 4"),
    ("train: {dropout: 1.0}\n", "train.dropout", "expected a probability in [0, 1), got 1.0"),
    ("screen: {proxy: {num_workers: 2, parallel: {tensor: 3}}}\n", "screen.proxy.parallel.tensor", "3 does not divide num_workers=2"),
    ("screen: {proxy: {num_workers: 2, parallel: {pipeline: 2}}}\n", "screen.proxy.parallel.pipeline",
     "pipeline parallelism takes zero_stage 1, got 0"),
])
def test_bad_values_name_their_key(cfg, text, key, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(cfg(text))
    assert exc.value.key == key
    assert str(exc.value).startswith(f"config key '{key}': ") and expected in str(exc.value)
    assert "\n" not in str(exc.value)


def test_rules_that_need_a_model_or_a_gpu_table_run_only_as_checks(cfg):
    """core/config.py knows no model sizes or GPUs (docs/architecture.md): train/rules.py's checks do."""
    assert ground.load_config(cfg("train: {model: 7b}\n")).train.model == "7b"
    with pytest.raises(ConfigError, match="'train.model': expected one of tiny"):
        load_config(cfg("train: {model: 7b}\n"))
    with pytest.raises(ConfigError, match="'screen.proxy.parallel.pipeline': 4 stages for the tiny model's 2 layers"):
        load_config(cfg("screen: {proxy: {num_workers: 4, zero_stage: 1, parallel: {pipeline: 4}}}\n"))


@pytest.mark.parametrize("text, message", [
    ('sources: [{name: a, format: csv, paths: ["x"]}]', r"'sources\[0\]\.format': expected one of 'pile'"),
    ("sources: [{name: a, format: jsonl}]", r"'sources\[0\]\.paths': missing"),
    ("sources: [{name: a, format: jsonl, paths: [x]}, {name: a, format: text, paths: [y]}]",
     r"'sources\[1\]\.name': duplicate source name 'a'"),
    ("workdir: w\n", r"'sources': missing"),
    ("sources: [unclosed\n", "is not valid YAML"),
    ("sources: [{name: a, format: jsonl, paths: [x], keep_subsets: [Pile-CC]}]",
     r"'sources\[0\]\.keep_subsets': only for format 'pile', this source is 'jsonl'"),
    ("sources: [{name: a, format: pile, paths: [x], keep_subsets: []}]", r"'sources\[0\]\.keep_subsets': expected at least one subset"),
    ("sources: [{name: a, format: pile, paths: [x], split: blank_lines}]", r"'sources\[0\]\.split': only for format 'text'"),
    ("sources: [{name: a, format: jsonl, paths: [x], zstd_window_log: 32}]",
     r"'sources\[0\]\.zstd_window_log': expected a zstd window's log2 size, 10 \(1 KiB\) to 31 \(2 GiB\), got 32"),
    ("sources: [{name: a, format: jsonl, paths: [x], zstd_window_log: 9}]",
     r"'sources\[0\]\.zstd_window_log': expected a zstd"),
    ("sources: [{name: a, format: pile, paths: [x]}]\ningest: {on_bad_input: skip}",
     r"'ingest\.on_bad_input': expected one of 'reject', 'fail'"),
])
def test_bad_source_entries(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, text))


def test_pile_keeps_opts_eight_subsets_unless_told(tmp_path):
    config = load_config(write_config(tmp_path, 'sources: [{name: p, format: pile, paths: [x]}, {name: t, format: text, paths: [y]}]'))
    assert config.sources[0].keep_subsets == OPT_PILE_SUBSETS and len(OPT_PILE_SUBSETS) == 8
    assert config.sources[1].keep_subsets is None
    config = load_config(write_config(tmp_path, 'sources: [{name: p, format: pile, paths: [x], keep_subsets: [Github]}]'))
    assert config.sources[0].keep_subsets == ["Github"]


def test_missing_input_paths_name_the_key(cfg, tmp_path):
    config = load_config(cfg(), ["sources.0.paths=[raw/*.jsonl, nowhere/*.zst]"])
    with pytest.raises(ConfigError, match=r"'sources\[0\]\.paths\[1\]': no file matches '.*nowhere/\*\.zst'"):
        check_inputs_exist(config)
    config = load_config(cfg("tokenize: {tokenizer: {kind: gpt2, vocab: v.json, merges: m.txt}}\n"))
    with pytest.raises(ConfigError, match=r"'tokenize.tokenizer.vocab': file '.*v\.json' does not exist"):
        check_inputs_exist(config)
    (tmp_path / "v.json").write_text("{}")
    (tmp_path / "m.txt").write_text("")
    config = load_config(cfg(f"tokenize: {{tokenizer: {{kind: gpt2, vocab: {tmp_path}/v.json, merges: {tmp_path}/m.txt, "
                             "fairseq_dict: ~/no-dict.txt}}\n"))
    with pytest.raises(ConfigError, match=r"'tokenize.tokenizer.fairseq_dict': file '/.*/no-dict\.txt' does not exist"):
        check_inputs_exist(config)


def test_set_overrides_are_typed_by_their_field(cfg):
    config = load_config(cfg(), [
        "dedup.threshold=0.9", "dedup.ngram=3", "normalize.ftfy=false", "train.lr=null",
        "mlflow.experiment=2024", "sources.0.text_field=body", "tokenize.tokenizer.vocab_size=512",
        "train.grad_clip=3e-1",
    ])
    assert config.train.grad_clip == 0.3  # exponent notation without a dot (a string to YAML 1.1)
    assert config.dedup.threshold == 0.9 and config.dedup.ngram == 3 and config.normalize.ftfy is False
    assert config.train.lr is None
    assert config.mlflow.experiment == "2024"  # a string field keeps the text verbatim
    assert config.sources[0].text_field == "body" and config.tokenize.tokenizer.vocab_size == 512


@pytest.mark.parametrize("item, message", [
    ("dedup.treshold=0.9", "config key 'dedup.treshold': unknown key"),
    ("dedup.threshold=abc", "config key 'dedup.threshold': expected a number, got 'abc' (str)"),
    ("eval.decontaminate.ngrams=13", "config key 'eval.decontaminate.ngrams': unknown key"),
    ("eval.decontaminate.ngram=five", "config key 'eval.decontaminate.ngram': expected an integer"),
    ("dedup.threshold", "--set expects dotted.key=value, got 'dedup.threshold'"),
    ("sources.5.name=x", "config key 'sources.5': expected a list index below 1"),
    ("dedup.threshold.x=1", "config key 'dedup.threshold.x': cannot set a key inside a value of type a number"),
    ("train.lr=[1, 2", "config key 'train.lr': --set value '[1, 2' is not a valid YAML value"),
])
def test_bad_set_overrides(cfg, item, message):
    with pytest.raises(ConfigError) as exc:
        load_config(cfg(), [item])
    assert str(exc.value).startswith(message)


def test_cli_exits_2_with_one_line_for_each_kind_of_mistake(cfg, capsys, tmp_path):
    cases = [
        (["--config", str(cfg("dedup: {treshold: 0.9}\n"))], "config key 'dedup.treshold': unknown key"),
        (["--config", str(cfg()), "--set", "train.zero_stage=five"], "config key 'train.zero_stage': expected an integer"),
        (["--config", str(cfg()), "--set", "sources.0.paths=[gone/*.jsonl]"], "config key 'sources[0].paths[0]': no file matches"),
        (["--config", str(tmp_path / "nope.yaml")], "does not exist"),
        (["--config", str(cfg()), "--only", "dedupe"], "unknown stage 'dedupe'; stages are: ingest, normalize, dedup"),
        (["--config", str(cfg()), "--only", "dedup", "--from", "ingest"], "--only and --from cannot be used together"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--config", str(cfg()), "--set", "name=../../elsewhere"], "config key 'name': expected letters, digits"),
        (["--config", str(cfg()), "--set", "sources.0.paths=[s3://AKIAKEY:s3cr3t@bucket/x.jsonl]"],
         "config key 'sources[0].paths[0]': a URI with a user or password in it"),
        (["--config", str(cfg()), "--set", "mlflow.tracking_uri=http://me:s3cr3t@mlflow:5000"],
         "config key 'mlflow.tracking_uri': a URI with a user or password in it"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err, (argv, err)
        assert len(err.splitlines()) == 1 and "s3cr3t" not in err, err  # a secret is never repeated
    assert not (tmp_path / "work").exists()  # nothing ran, nothing was created


@pytest.mark.parametrize("uri, problem", [
    ("s3://AKIAKEY:s3cr3t@bucket/x.jsonl", "a user or password in it"),
    ("hdfs://me@namenode/x.jsonl", "a user or password in it"),
    ("abfs://me:s3cr3t@account.dfs.core.windows.net/x.jsonl", "a user or password in it"),
    ("https://acct.blob.core.windows.net/c/x.jsonl?sv=2024-11-04&se=2030-01-01&sig=s3cr3t",
     "a secret in its query string ('sig')"),
    ("s3://bucket/x.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=s3cr3t",
     "a secret in its query string ('X-Amz-Signature')"),
    ("http://mlflow:5000/?client_secret=s3cr3t", "a secret in its query string ('client_secret')"),
    ("abfs://corpus@account.dfs.core.windows.net/pile/*.jsonl.zst", None),  # a container, not a user
    ("abfss://corpus@account.dfs.core.windows.net/x.jsonl", None),
    ("wasbs://corpus@account.blob.core.windows.net/x.jsonl", None),
    ("s3://bucket/RC_2019-0?.zst", None),  # a glob's `?` is no query
    ("data/me@home/x.jsonl", None),  # a path, not a URI
])
def test_a_uri_with_a_credential_is_refused_and_azures_container_is_not_one(uri, problem):
    from core.config import uri_secret

    assert uri_secret(uri) == problem


def test_credentials_in_a_config_uri_or_the_tracking_uri_from_the_environment_stop_the_load(cfg, monkeypatch):
    """A source's URI with a SAS token is refused as one with a password is; `abfs://container@account` loads; the
    tracking URI from $MLFLOW_TRACKING_URI, which becomes the config's (printed, copied into MLflow's params), is
    checked too. No message repeats the secret."""
    sas = "sources.0.paths=['https://acct.blob.core.windows.net/c/x.jsonl?sv=2024-11-04&sig=s3cr3t']"
    with pytest.raises(ConfigError, match=r"^config key 'sources\[0\]\.paths\[0\]': a URI with a secret in its "
                                          r"query string \('sig'\): give credentials through the environment") as exc:
        load_config(cfg(), [sas])
    assert "s3cr3t" not in str(exc.value)
    azure = "abfs://corpus@account.dfs.core.windows.net/x.jsonl"
    assert load_config(cfg(), [f"sources.0.paths=[{azure}]"]).sources[0].paths == [azure]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://admin:s3cr3t@10.0.0.5:5000")
    with pytest.raises(ConfigError) as exc:
        load_config(cfg())
    assert str(exc.value).startswith("$MLFLOW_TRACKING_URI is a URI with a user or password in it: give MLflow's user "
                                     "and password in ~/.mlflow/credentials") and "s3cr3t" not in str(exc.value)


def test_mlflows_admin_password_is_the_credentials_files_or_a_stop(tmp_path, monkeypatch):
    """cluster.yaml's head start-up creates MLflow's admin with this password: "None" was one, when the file had
    none."""
    from core.tracking import admin_password

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    (tmp_path / ".mlflow").mkdir()
    (tmp_path / ".mlflow" / "credentials").write_text("[mlflow]\nmlflow_tracking_username = admin\n")
    with pytest.raises(SystemExit, match=r"^error: no MLflow password: write mlflow_tracking_password in "):
        admin_password()
    (tmp_path / ".mlflow" / "credentials").write_text("[mlflow]\nmlflow_tracking_password = s3cr3t\n")
    assert admin_password() == "s3cr3t"


def test_script_exit_code_and_single_line_from_a_real_process(cfg):
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(cfg()),
                           "--set", "dedup.threshold=2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: config key 'dedup.threshold': expected a Jaccard similarity in (0, 1], got 2.0"]


@pytest.mark.parametrize("item, message", [
    ("dedup.ngram=0", "config key 'dedup.ngram': expected a value >= 1, got 0"),
    ("train.max_steps=0", "config key 'train.max_steps': expected a value >= 1, got 0"),
    ("train.lr=-1e-4", "config key 'train.lr': expected a positive number, got -0.0001"),
    ("train.cpus_per_worker=0", "config key 'train.cpus_per_worker': expected a positive number, got 0.0"),
    ("tokenize.tokenizer.vocab_size=100", "config key 'tokenize.tokenizer.vocab_size': expected a value >= 260, got 100"),
    ("ray.num_cpus=0", "config key 'ray.num_cpus': expected a value >= 1, got 0"),
])
def test_out_of_range_values(cfg, item, message):
    with pytest.raises(ConfigError) as exc:
        load_config(cfg(), [item])
    assert str(exc.value) == message


def test_a_proxy_run_is_trained_with_every_engine_key_of_its_section(cfg):
    """screen.proxy and train share one base (EngineConfig): each of its keys set in screen.proxy reaches the proxy
    run's TrainConfig as it is, none copied by hand, and both sections keep their own defaults."""
    import dataclasses

    from screen.config import ProxyConfig
    from train.config import EngineConfig, TrainConfig
    from screen.stage import proxy_train_config

    config = load_config(cfg(), ["screen.proxy.model=125m", "screen.proxy.num_workers=2", "screen.proxy.gpus_per_worker=0",
                                 "screen.proxy.cpus_per_worker=0.25", "screen.proxy.zero_stage=1",
                                 "screen.proxy.precision=bf16", "screen.proxy.micro_batch_size=3",
                                 "screen.proxy.global_batch_tokens=12288", "screen.proxy.lr=0.001",
                                 "screen.proxy.parallel.tensor=2"])
    proxy = proxy_train_config(config.screen, seed=3)
    for f in dataclasses.fields(EngineConfig):
        assert getattr(proxy, f.name) == getattr(config.screen.proxy, f.name), f.name
    assert (ProxyConfig().num_workers, ProxyConfig().zero_stage, TrainConfig().num_workers, TrainConfig().zero_stage) == (1, 0, 2, 2)


def test_the_screens_proxies_take_the_training_layout_keys(cfg):
    from screen.stage import proxy_train_config

    config = load_config(cfg(), ["screen.proxy.num_workers=2", "screen.proxy.parallel.tensor=2"])
    proxy = proxy_train_config(config.screen, seed=3)
    assert proxy.parallel.tensor == 2 and proxy.data_parallel == 1 and proxy.seed == 3
    config = load_config(cfg(), ["screen.proxy.num_workers=4", "screen.proxy.zero_stage=1",
                                 "screen.proxy.parallel={tensor: 2, pipeline: 2}"])
    proxy = proxy_train_config(config.screen, seed=3)
    assert proxy.parallel.pipeline == 2 and proxy.data_parallel == 1
