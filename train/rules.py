"""The config rules that need the model's sizes (model/configs.py) or the GPU tables (train/plan/hardware.py).

core/config.py validates what it can know by itself: types, ranges, and the layout rules (`layout_rule`).
What depends on a model or a node lives here, where both are known, and runs when a config is loaded
with it: `load_config(path, checks=(check_config,))` (pipelines/stages.py's CHECKS). Each rule is applied
to every training section, train and screen.proxy, with the same keys and messages.
"""

from __future__ import annotations

from core.config import ConfigError, PipelineConfig, ProxyConfig, TrainConfig
from model.configs import CONFIGS
from train.plan.hardware import NODES


def check_config(config: PipelineConfig) -> None:
    """Every rule of this module, on screen.proxy and then train (the order the sections are read in)."""
    proxy = config.screen.proxy
    check_section("screen.proxy", proxy)
    check_batch("screen.proxy", proxy.model, proxy.global_batch_tokens, proxy.seq_len, proxy.micro_batch_size,
                proxy.num_workers // proxy.parallel.model_parallel)
    train = config.train
    check_section("train", train)
    check_batch("train", train.model, train.global_batch_tokens, config.tokenize.seq_len, train.micro_batch_size,
                train.data_parallel, seq_len_key="tokenize.seq_len")


def check_section(key: str, section: TrainConfig | ProxyConfig) -> None:
    """A training section's layout against its model's layers and widths and against the largest node."""
    t, p = section.parallel.tensor, section.parallel.pipeline
    model = CONFIGS.get(section.model)  # an unknown model is check_batch's error
    if model is not None and p > model.n_layer:
        raise ConfigError(f"{key}.parallel.pipeline", f"{p} stages for the {section.model} model's {model.n_layer} "
                          "layers: every stage needs at least one")
    for what in ("n_head", "ffn_dim", "vocab_size"):
        if model is not None and getattr(model, what) % t:
            raise ConfigError(f"{key}.parallel.tensor", f"{t} does not divide the {section.model} model's {what} "
                              f"({getattr(model, what)})")
    per_node = max(node.gpus for node in NODES.values())
    if section.gpus_per_worker and t * section.gpus_per_worker > per_node:
        raise ConfigError(f"{key}.parallel.tensor", f"a tensor group of {t} workers x {section.gpus_per_worker:g} GPUs "
                          f"would span nodes of {per_node} GPUs: its all-reduces, two per layer, would cross the network")


def check_batch(key: str, model: str, batch_tokens: int | None, seq_len: int, micro: int, workers: int,
                seq_len_key: str | None = None) -> None:
    """The model exists, and its global batch splits into micro-batches on every worker."""
    if model not in CONFIGS:
        raise ConfigError(f"{key}.model", f"expected one of {', '.join(CONFIGS)}, got {model!r}")
    batch_tokens = batch_tokens or CONFIGS[model].batch_tokens
    sequences = batch_tokens // seq_len
    if sequences == 0 or sequences % (micro * workers):
        raise ConfigError(f"{key}.global_batch_tokens", f"{batch_tokens} tokens are {sequences} sequences of "
                          f"{seq_len_key or key + '.seq_len'}={seq_len}: not a multiple of micro_batch_size x num_workers"
                          f" / (parallel.tensor x parallel.pipeline) = {micro * workers}")
