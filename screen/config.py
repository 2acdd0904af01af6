"""The screen's config section (screen/): its proxy runs, its rounds and its drop rule.

The proxy section is a training section (train/config.py's EngineConfig) with a few fields of its own;
screen/stage.py turns it into a TrainConfig with those fields as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import ConfigError, at_least
from corpus.config import TokenizerConfig
from train.config import EngineConfig


@dataclass
class ProxyConfig(EngineConfig):
    """The proxy model of the screen: every proxy run trains it with these settings (only the data and seed differ).
    OPT measured spikes at 1.3B; the defaults are a laptop's."""

    num_workers: int = 1  # Ray Train workers per proxy run
    cpus_per_worker: float = 1.0
    zero_stage: int = 0
    seq_len: int = 2048
    warmup_steps: int = 10  # then a constant LR: no decay to hide spikes

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "seq_len")
        at_least(self, key, 0, "warmup_steps")
        self.validate_engine(key)


@dataclass
class ScreenConfig:
    """The subset screen (screen/): proxy runs per subset, spike scores, the drop rule (screen/score.py)."""

    enabled: bool = True  # false: every document passes, no proxy runs
    sources: list[str] | None = None  # whose subsets are screened; None: every source of format pile (as OPT)
    subsets: list[str] | None = None  # None: every subset of `sources` that reaches the screen
    steps: int = 100  # per proxy run
    seeds: int = 2  # proxy runs per mixture in the first round (seed, seed + 1, ...); at least 2
    max_seeds: int = 6  # inconclusive subsets get more seeds, round by round, up to this many
    seed: int = 0  # also the sample's
    upweight: float = 0.3  # the candidate subset's share of its mixture's tokens
    ratio: float = 2.0  # the line: a subset whose proxies are this many times as rough as the baseline mix's is spiky
    alpha: float = 0.05  # the chance of a wrong drop (or keep) of a subset on the line, over all its looks
    inconclusive: Literal["keep", "drop"] = "keep"  # what becomes of a subset still undecided at max_seeds
    # Subsets (a source without subsets is its own, e.g. reddit) dropped from training whatever the screen measures:
    # a data ablation that keeps the evaluation set (drawn before, at normalize), where removing a source from
    # `sources` would change it. Their documents go to dropped/ with the reason, as the screen's drops do.
    drop: list[str] = field(default_factory=list)
    spike_ratio: float = 0.25  # a step this far above its fit is counted as a spike (reported, not judged)
    burn_in: int = 10  # first steps not scored
    concurrent_runs: int = 2  # Ray Train jobs of proxy runs at a time
    runs_per_job: int = 1  # proxy runs a Ray Train job takes, one after another, over the rounds (a laptop: many)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # the proxy runs' (set it as tokenize's)

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "concurrent_runs", "runs_per_job")
        at_least(self, key, 2, "seeds")
        at_least(self, key, 0, "burn_in", "spike_ratio")
        if self.max_seeds < self.seeds:
            raise ConfigError(f"{key}.max_seeds", f"expected at least seeds = {self.seeds}, got {self.max_seeds}")
        if not self.ratio > 1.0:
            raise ConfigError(f"{key}.ratio", f"expected a ratio above 1 (the line above the baseline mix), got {self.ratio}")
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"{key}.alpha", f"expected an error rate in (0, 0.5), got {self.alpha}")
        if self.inconclusive not in ("keep", "drop"):
            raise ConfigError(f"{key}.inconclusive", f"expected keep or drop, got {self.inconclusive!r}")
        if self.steps < self.burn_in + 4:
            raise ConfigError(f"{key}.steps", f"expected at least burn_in + 4 = {self.burn_in + 4} steps, got {self.steps}")
        if not 0.0 < self.upweight < 1.0:
            raise ConfigError(f"{key}.upweight", f"expected a fraction in (0, 1), got {self.upweight}")
        if self.subsets == []:
            raise ConfigError(f"{key}.subsets", "expected at least one subset (or leave it out: every subset of `sources`)")
