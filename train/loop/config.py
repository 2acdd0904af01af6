"""What every worker of a training run is handed: the validated train section and what follows from it.

The stage (and the screen, for each proxy run) builds one `LoopConfig` on the driver; Ray Train
pickles it to the workers. Its types go all the way to the loop: a misspelt field is an
AttributeError at the line that reads it, and a bad setting was already refused at config load
with its key. `loop_config.json` in the run folder is this object as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from train.config import TrainConfig
from model.configs import OPTConfig, get
from train.loader import read_index
from train.schedule import Schedule


@dataclass(frozen=True)
class LoopConfig:
    train: TrainConfig  # the section as validated (train, or a screen proxy run's)
    architecture: OPTConfig  # train.model, with the shards' vocabulary, the section's dropout and recompute
    run_dir: str  # checkpoints, metrics.jsonl, incidents.jsonl, the logbook: the run's home across restarts
    shards: str  # the tokenize stage's output (or a proxy run's mixture)
    export_dir: str | None  # the Hugging Face export; None: none (proxy runs)
    seq_len: int
    global_batch: int  # sequences per step, over all data-parallel ranks
    accumulation: int  # micro-batches per data-parallel rank per step, on the configured replicas (accumulation_at)
    peak_lr: float  # train.lr, or the model's from OPT's Table 1
    warmup_steps: int
    total_steps: int  # the schedule's length (total_tokens' worth of steps)
    last_step: int  # where this run stops (train.max_steps, or total_steps)
    eval_micro_batch: int
    launched_at: float = 0.0  # when the driver launched this run: failures before it belong to an earlier launch


    def accumulation_at(self, replicas: int) -> int:
        """Micro-batches per data-parallel rank per step on `replicas` replicas: an elastic run started short makes up
        the missing ones with more, so that every step still takes the global batch. Where the replicas do not divide
        its micro-batches, the most any rank has: the others pad (train/loop/step.py `Feed`)."""
        return -(-self.micro_batches // replicas)

    @property
    def micro_batches(self) -> int:
        """The global batch's micro-batches, over all replicas."""
        return self.global_batch // self.train.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    def schedule(self) -> Schedule:
        """The run's learning-rate schedule, from its steps and the section's final ratio."""
        return Schedule(self.peak_lr, self.warmup_steps, self.total_steps, self.train.final_lr_ratio)

    def cut_short(self) -> str | None:
        """What a person must know of a run that stops before its learning rate has decayed (None: it has). Its
        final weights follow its last large updates: the laptop's seeds, cut at 84% of the peak rate, were 30x as
        spread and in two clusters, and compare.py's verdicts missed their stated rate on them (docs/benchmarks.md,
        "Ablation verdicts, measured")."""
        if self.last_step >= self.total_steps:
            return None
        rate = self.schedule().lr(self.last_step) / self.peak_lr
        return (f"max_steps {self.last_step} stops the run at {rate:.0%} of its peak learning rate, which decays over "
                f"{self.total_steps} steps (total_tokens): seeds cut before their decay are noisier, and compare.py's "
                f"verdicts on them less sure than stated; for an ablation, set train.total_tokens to the tokens it trains")


def loop_config(cfg: TrainConfig, shards: str, folder: Path, *, export_dir: str | None) -> LoopConfig:
    """Batch and schedule in steps from our token-based config and the shards' index. Raises ValueError
    when the shards cannot feed the configured batch."""
    index = read_index(shards)
    seq_len = index["seq_len"]
    model = get(cfg.model)
    model = model.replace(vocab_size=index["vocab_size"], max_seq_len=max(seq_len, model.max_seq_len),
                          activation_checkpointing=cfg.activation_checkpointing,
                          dropout=model.dropout if cfg.dropout is None else cfg.dropout)
    batch_tokens = cfg.global_batch_tokens or model.batch_tokens
    global_batch = max(1, batch_tokens // seq_len)
    per_rank = cfg.micro_batch_size * cfg.data_parallel  # the ranks of a tensor group and of a pipeline share their batch
    if global_batch % per_rank:
        raise ValueError(f"a global batch of {global_batch} sequences ({batch_tokens} tokens / seq_len {seq_len}) does "
                         f"not split into micro-batches of {cfg.micro_batch_size} on {cfg.data_parallel} data-parallel ranks")
    if index["sequences"] < global_batch:
        raise ValueError(f"{shards}: {index['sequences']} training sequences of {seq_len} tokens, fewer than one "
                         f"global batch of {global_batch}: more data, a shorter tokenize.seq_len or a smaller batch")
    tokens_per_step = global_batch * seq_len
    total_steps = max(1, cfg.total_tokens // tokens_per_step)
    return LoopConfig(
        train=cfg, architecture=model, run_dir=str(folder), shards=str(shards), export_dir=export_dir, seq_len=seq_len,
        global_batch=global_batch, accumulation=global_batch // per_rank, peak_lr=cfg.lr or model.lr,
        warmup_steps=cfg.warmup_tokens // tokens_per_step, total_steps=total_steps,
        last_step=cfg.max_steps or total_steps, eval_micro_batch=cfg.eval_micro_batch_size or 4 * cfg.micro_batch_size,
        launched_at=time.time())
