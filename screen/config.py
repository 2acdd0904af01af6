"""The screen's config section (screen/): its proxy runs, its rounds and its drop rule.

The proxy section is a training section (train/config.py's EngineConfig) with a few fields of its own;
screen/stage.py turns it into a TrainConfig with those fields as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import LAYOUT, ConfigError, at_least
from corpus.config import TokenizerConfig
from train.config import EngineConfig


@dataclass
class ProxyConfig(EngineConfig):
    """The proxy model of the screen: every proxy run trains it with these settings (only the data and seed differ).
    OPT measured spikes at 1.3B; the defaults are a laptop's."""

    num_workers: int = field(default=1, metadata={LAYOUT: True})
    """Ray Train workers per proxy run (one per GPU on a cluster). The training stage's default is 2."""
    cpus_per_worker: float = field(default=1.0, metadata={LAYOUT: True})
    """CPUs each proxy run's worker asks Ray for."""
    zero_stage: int | Literal["auto"] = 0
    """The [ZeRO](glossary.md#zero) stage of the proxy runs, 0 to 3 (fp16 needs 1 to 3), or `auto` (as
    `train.zero_stage`)."""
    seq_len: int = 2048
    """Tokens per proxy training sequence. The proxy mixtures are cut to it, not to `tokenize.seq_len`."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warmup; then the rate stays constant, since a decay could hide spikes."""

    @property
    def batch_tokens(self) -> int:
        """Tokens per proxy step: `global_batch_tokens`, or the model's batch in OPT's Table 1."""
        from model.configs import get

        return self.global_batch_tokens or get(self.model).batch_tokens

    def validate(self, key: str) -> None:
        at_least(self, key, 1, "seq_len")
        at_least(self, key, 0, "warmup_steps")
        self.validate_engine(key)


@dataclass
class ScreenConfig:
    """The subset screen (screen/): proxy runs per subset, spike scores, the drop rule (screen/score.py)."""

    enabled: bool = True
    """`false`: every document passes and no [proxy run](glossary.md#proxy-run) is made."""
    sources: list[str] | None = None
    """The sources whose subsets are screened, by name. `null`: every source of format `pile`, as OPT screened the
    Pile's subsets."""
    subsets: list[str] | None = None
    """The subsets to screen; each must reach the screen. `null`: every subset of `sources` that reaches it."""
    steps: int = 100
    """Training steps per proxy run; at least `burn_in` + 4."""
    seeds: int = 2
    """Proxy runs per mixture in the first round, with seeds `seed`, `seed` + 1, ...; at least 2."""
    max_seeds: int = 6
    """Subsets still undecided get more seeds, round by round, up to this many; at least `seeds`."""
    seed: int = 0
    """The first proxy run's seed, and the seed of the screen's sample and of its tokenizer's training sample."""
    upweight: float = 0.3
    """The candidate subset's share of its mixture's tokens, in (0, 1); the rest is the baseline mix (every
    document not in a screened subset)."""
    ratio: float = 2.0
    """The line, above 1: a subset whose proxy runs are this many times as [rough](glossary.md#roughness) as the
    baseline mix's under the same seeds is spiky. It is dropped when its interval lies above the line, kept when
    below."""
    alpha: float = 0.05
    """The chance of a wrong drop or keep of a subset that sits on the line, over all its rounds, in (0, 0.5)."""
    inconclusive: Literal["keep", "drop"] = "keep"
    """What becomes of a subset still undecided at `max_seeds`; it is marked inconclusive either way."""
    drop: list[str] = field(default_factory=list)
    """Subsets dropped from training whatever the screen measures (a source without subsets, such as `reddit`,
    is its own). Their documents go to `dropped/` with the reason. Use it to train without a subset and keep the
    evaluation set, which removing it from `sources` would change."""
    spike_ratio: float = 0.25
    """A step whose gradient norm is this fraction above its fitted trend is counted as a spike. Spikes are
    reported, not used in the decision."""
    burn_in: int = 10
    """First steps of each proxy run left out of its score: every run's gradient norm falls steeply at the
    start."""
    concurrent_runs: int = 2
    """Ray Train jobs of proxy runs at a time, taking the runs from one queue. A later round may add seeds to
    fill jobs that would otherwise idle."""
    runs_per_job: int = 1
    """Proxy runs one Ray Train job takes, one after another, over the rounds. 1 is a job per run, so a failure
    touches one run. On a laptop, more: a job's start costs more than a tiny proxy run."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    """The proxy model and how each proxy run trains it: the training keys, with defaults of its own. Every proxy
    run has the same settings; only its data and seed differ. OPT measured spikes at the 1.3B scale."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The proxy runs' tokenizer, trained on or read for the screen's sample. Set it the same as
    `tokenize.tokenizer`."""

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
