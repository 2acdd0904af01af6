"""The screen on a laptop: what it costs (`cost`), and how often it is right (`power`).

    python benchmarks/bench_screen.py cost [--out /tmp/bench_screen]
    python benchmarks/bench_screen.py power [--draws 12] [--max-seeds 6] [--record-steps 60] [--steps 30,40,60]
                                            [--out /tmp/bench_screen_power]

`cost`:

configs/local.yaml on the sample corpus (8 Pile subsets + the baseline, 2 seeds in the first
round, more for inconclusive subsets; the tiny model, local.yaml's steps each, 2 Ray Train jobs
at a time). The screen stage runs twice on the same dedup output, side by side: every proxy run
its own Ray Train job (`runs_per_job: 1`, the cluster configs' setting: the baseline) and
local.yaml's runs per job (jobs that take runs from the queue over the rounds). Reports the
stage's seconds, seconds per proxy run and the ratio, and checks that both made the same
decisions with the same scores (packing changes where runs execute, not what they compute).

`power`: how often the screen drops a planted spiky subset, and how often a clean one.
- Draw k is a sample corpus of its own (seed 1000 + k) with three of OPT's 8 Pile subsets planted
  spiky, a different three each draw: one in 6, 12 and 24 of their documents (STRENGTHS); the
  other five are clean. The other sources vary with k (COMPOSITIONS): all, Reddit without the
  RS_* submissions, no CC-News, neither. One more corpus is the case that started this work:
  the default sample (seed 0, HackerNews one in 6) with Reddit comments only.
- Each corpus runs local.yaml's ingest, normalize, dedup and screen, the screen with `max_seeds`
  seeds of every mixture in one round (seeds = max_seeds: nothing adaptive), so that every proxy
  run any schedule could ask for exists. A proxy run is a function of its mixture and seed (the
  stage's test checks this to the last digit), so any rule and schedule is then replayed exactly
  from these runs with screen/score.py's own `adaptive` and `decide`: local.yaml's (adaptive), and
  every fixed number of seeds at the same ratio and alpha, side by side.
- `--record-steps N` runs the proxies for N steps (default: local.yaml's `steps`), and `--steps` replays
  local.yaml's rule on each run's first n steps, for each n listed: how the screen would decide with
  shorter proxy runs. The learning rate is constant after warmup and the loader's order does not depend on
  the run's length, so a run's first n steps are an n-step run on the same mixture. (A screen of n steps
  samples a mixture sized for n steps: a smaller sample of the same corpus, so the same in distribution,
  not to the digit.) At n = local.yaml's steps the replay is the screen itself.
- `--check` (on by default) also runs the first draw's screen with local.yaml's own adaptive
  settings and compares it with the replay: its decisions, proxy runs and scores when the runs were
  recorded at local.yaml's steps; its decisions when they were recorded longer (then replayed on their
  first local.yaml's steps).
Reports per strength the share of planted subsets dropped, the share of clean ones dropped, the
inconclusive ones, proxy runs per screen, and the per-seed noise of the paired effects.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import provenance  # noqa: E402  (benchmarks/provenance.py: a script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def full(out: Path, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--workdir", str(out / "work"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def screen(out: Path, runs_per_job: int) -> dict:
    full(out, "--only", "screen", "--force", "--set", f"screen.runs_per_job={runs_per_job}")
    return json.loads((out / "work" / "screen" / "manifest.json").read_text())


def cost(args) -> int:
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    full(out, "--only", "ingest,normalize,dedup")
    import yaml

    packed = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["screen"]["runs_per_job"]
    results = {n: screen(out, n) for n in (1, packed)}
    print("configs/local.yaml, sample corpus")
    runs = len(results[1]["proxy_runs"])
    print(f"{'runs per Ray Train job':<24} {'jobs':>5} {'screen s':>9} {'s per proxy run':>16}")
    for n, m in results.items():
        seconds = m["metrics"]["seconds"]
        jobs = len(list((Path(m["output"]).parent / "proxy").glob("job-*")))
        print(f"{n:<24} {jobs:>5} {seconds:>9.1f} {seconds / runs:>16.2f}")
    ratio = results[packed]["metrics"]["seconds"] / results[1]["metrics"]["seconds"]
    print(f"packed / one job per run: {ratio:.2f}x the time")
    same = results[1]["scores"] == results[packed]["scores"] and \
        results[1]["dropped_subsets"] == results[packed]["dropped_subsets"]
    print(f"same scores and decisions: {same}; dropped {results[packed]['dropped_subsets']}; "
          f"mean roughness {results[packed]['scores']}")
    return 0 if same else 1


OPT_PILE = 8  # subsets screened per corpus
CLUSTER_CONCURRENT = 8  # the cluster configs' screen.concurrent_runs: a round of n runs takes ceil(n / 8) run times
STRENGTHS = (6, 12, 24)  # one in N of a planted subset's documents spiky
COMPOSITIONS = ("all", "no-submissions", "no-ccnews", "no-submissions-no-ccnews")
PACKED_RUNS = 9  # runs per job that a round would fill as well: local.yaml's jobs of 9 runs before the queue


def corpus_config(folder: Path, sample: Path, composition: str, overrides: dict) -> Path:
    """local.yaml on `sample`, with the sources of `composition` and the screen's `overrides`."""
    import yaml

    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    local.pop("sample_corpus")
    local.pop("sample_spiky_subset")
    sources = []
    for source in local["sources"]:
        if source["name"] == "ccnews" and "no-ccnews" in composition:
            continue
        paths = [p for p in source["paths"] if not ("no-submissions" in composition and "/RS_" in p)]
        sources.append({**source, "paths": [str(sample / Path(p).relative_to("data/sample")) for p in paths]})
    local["sources"] = sources
    local["workdir"] = str(folder / "work")
    local["screen"].update(overrides)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(local, sort_keys=False))
    return path


def screen_corpus(folder: Path, seed: int, planted: dict[str, int], composition: str, overrides: dict,
                  prefixes: tuple[int, ...] = ()) -> dict:
    """One corpus through local.yaml's corpus stages and screen: a summary of the screen, with every run's score on
    its first n steps for each n of `prefixes`. Cached in folder, so that a stopped benchmark goes on where it
    stopped; a cache from other settings (steps, seeds; local.yaml's or the overrides) is run again."""
    import yaml

    from corpus.sample import write_sample

    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["screen"]
    want = {**{key: local[key] for key in ("steps", "seeds", "max_seeds")}, **overrides}

    def fits(config: dict) -> bool:
        return all(config.get(key) == value for key, value in want.items())

    done = folder / "screen.json"
    if done.exists() and "unadjusted" in (found := json.loads(done.read_text())) and fits(found.get("config", {})) \
            and set(map(str, prefixes)) <= set(found.get("prefixes", {})):
        return found
    manifest = folder / "work" / "screen" / "manifest.json"
    if not (manifest.exists() and fits(json.loads(manifest.read_text())["config"])):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        write_sample(folder / "sample", seed=seed, spiky=planted)
        config = corpus_config(folder, folder / "sample", composition, overrides)
        cmd = [sys.executable, str(ROOT / "pipelines" / "full.py"), "--config", str(config), "--only",
               "ingest,normalize,dedup,screen"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    result = summary(json.loads(manifest.read_text()), seed, planted, composition, prefixes)
    done.write_text(json.dumps(result))
    return result


def summary(m: dict, seed: int, planted: dict[str, int], composition: str, prefixes: tuple[int, ...] = ()) -> dict:
    """A screen's decisions and every proxy run's score; also the score before this work (spike_score: the mean
    excess over the neighbourhood's median plus growth) from the same runs' grad norms, for the old rule; and
    for each n of `prefixes`, every run's score on its first n steps (scored as the stage scores a run)."""
    from screen import mixture
    from screen.score import BASELINE, roughness
    from screen.stage import slug
    from train.spikes import read_grad_norms, read_run, spike_score

    stage = Path(m["output"]).parent
    cfg = m["config"]  # the screen's section
    burn_in, spike_ratio = cfg["burn_in"], cfg["spike_ratio"]
    global_batch = cfg["proxy"]["global_batch_tokens"] // cfg["proxy"]["seq_len"]
    before, unadjusted, prefix = {}, {}, {str(n): {} for n in prefixes}
    for r in m["proxy_runs"]:
        key, metrics = f"{r['subset']}\0{r['seed']}", stage / r["run_dir"]
        before[key] = spike_score(read_grad_norms(metrics)).score
        batches, grad_norms = read_run(metrics)
        unadjusted[key] = roughness(batches, grad_norms).score  # no composition term
        if not prefixes:
            continue
        shares = None if r["subset"] == BASELINE else \
            mixture.subset_shares(stage / "mixtures" / slug(r["subset"]), batches, global_batch, r["seed"])
        for n in prefixes:
            first = batches < n  # step s trains global batch s - 1
            prefix[str(n)][key] = roughness(batches[first], grad_norms[first], None if shares is None else shares[first],
                                            burn_in=burn_in, spike_ratio=spike_ratio).score
        if cfg["steps"] in prefixes and prefix[str(cfg["steps"])][key] != r["score"]:
            raise SystemExit(f"{key!r}: rescored {prefix[str(cfg['steps'])][key]}, the stage scored {r['score']}")
    return {"seed": seed, "planted": planted, "composition": composition, "seconds": m["metrics"]["seconds"], "config": cfg,
            "decisions": m["decisions"], "runs": {f"{r['subset']}\0{r['seed']}": r["score"] for r in m["proxy_runs"]},
            "before": before, "unadjusted": unadjusted, "prefixes": prefix}


def scores_of(corpus: dict, score: str = "runs") -> dict[str, dict[int, float]]:
    """A corpus's recorded proxy scores ("runs", "before", "unadjusted", or "steps=n": on the first n steps), as
    {mixture: {seed: score}}."""
    out: dict[str, dict[int, float]] = {}
    found = corpus["prefixes"][score.removeprefix("steps=")] if score.startswith("steps=") else corpus[score]
    for key, value in found.items():
        name, seed = key.split("\0")
        out.setdefault(name, {})[int(seed)] = value
    return out


def old_rule(corpus: dict, seeds: int = 2, margin: float = 15.0, sigmas: float = 3.0) -> dict[str, str]:
    """The rule before this work, on the score before it: dropped when the mean spike score over the first `seeds`
    seeds exceeds the baseline's mean by more than max(margin, sigmas x the baseline's sd over seeds)."""
    import numpy as np

    from screen.score import BASELINE

    by = {name: [v for k, v in sorted(values.items()) if k < seeds] for name, values in scores_of(corpus, "before").items()}
    base = np.asarray(by.pop(BASELINE))
    limit = base.mean() + max(margin, sigmas * base.std(ddof=1))
    return {subset: "drop" if np.mean(v) > limit else "keep" for subset, v in by.items()}


def replay(corpus: dict, *, seeds: int, max_seeds: int, ratio: float, alpha: float, slots: int = 1,
           score: str = "runs") -> tuple[dict, list[int]]:
    """A schedule and rule run on a corpus's recorded proxy runs: (decisions, proxy runs per round). `score`:
    "runs" (the stage's), "unadjusted" (the roughness without its composition term) or "steps=n" (the stage's
    on each run's first n steps)."""
    from screen.score import BASELINE, adaptive

    scores = {(name, seed): v for name, values in scores_of(corpus, score).items() for seed, v in values.items()}
    subsets = sorted({name for name, _ in scores if name != BASELINE})

    def run(todo):
        return {key: scores[key] for key in todo}

    decisions, rounds = adaptive(subsets, run, seeds=seeds, max_seeds=max_seeds, ratio=ratio, alpha=alpha, slots=slots)
    return decisions, [len(r) for r in rounds]


def tally(corpora: list[dict], **rule) -> dict:
    """Detection per strength, false drops, inconclusive and proxy runs of one rule over the corpora
    (rule {"before": True}: the old score and rule, on each corpus's first 2 seeds)."""
    out = {"detected": {n: [0, 0] for n in STRENGTHS}, "clean_dropped": [0, 0], "inconclusive": 0, "runs": 0,
           "rounds": 0, "waves": 0, "wrong": []}
    for corpus in corpora:
        if rule.get("before"):
            outcomes, rounds = old_rule(corpus), [2 * (OPT_PILE + 1)]
        else:
            decisions, rounds = replay(corpus, **rule)
            outcomes = {s: d.outcome for s, d in decisions.items()}
        out["runs"] += sum(rounds)
        out["rounds"] += len(rounds)
        out["waves"] += sum(-(-n // CLUSTER_CONCURRENT) for n in rounds)
        for subset, outcome in outcomes.items():
            out["inconclusive"] += outcome == "inconclusive"
            if subset in corpus["planted"]:
                hit = out["detected"][corpus["planted"][subset]]
            else:
                hit = out["clean_dropped"]
            hit[0] += outcome == "drop"
            hit[1] += 1
            if (outcome == "drop") != (subset in corpus["planted"]):
                out["wrong"].append(f"seed {corpus['seed']}: {subset} {outcome}")
    return out


def noise(corpora: list[dict], score: str = "runs") -> dict:
    """The paired effects per seed, ln(subset's roughness / baseline's), of clean and planted subsets; and the
    mean effect of each clean subset over the draws where it was clean."""
    import numpy as np

    from screen.score import BASELINE, effects

    clean, planted, spread, by_subset = [], {}, [], {}
    for corpus in corpora:
        scores = scores_of(corpus, score)
        baseline = scores.pop(BASELINE)
        for subset, values in effects(scores, baseline).items():
            values = np.asarray(values)
            if subset in corpus["planted"]:
                planted.setdefault(corpus["planted"][subset], []).append(float(values.mean()))
            else:
                clean.append(values)
                by_subset.setdefault(subset, []).extend(values)
            spread.append(values - values.mean())
    c = np.concatenate(clean)
    return {"clean_mean": float(c.mean()), "clean_sd": float(c.std(ddof=1)), "clean_max": float(c.max()),
            "clean_subset_means_max": float(max(v.mean() for v in clean)),
            "planted_means": {every: (min(v), float(np.mean(v))) for every, v in sorted(planted.items())},
            "within_sd": float(np.sqrt(sum((v ** 2).sum() for v in spread) / sum(len(v) - 1 for v in spread))),
            "clean_by_subset": {s: round(float(np.exp(np.mean(v))), 2) for s, v in sorted(by_subset.items())}}


def rate(hit: list[int]) -> str:
    return f"{hit[0]}/{hit[1]} ({100 * hit[0] / max(1, hit[1]):.0f}%)"


def check(out: Path, first: dict, local: dict, schedule: dict, rule: dict, recorded: int) -> bool:
    """Draw 0's screen run for real with local.yaml's adaptive settings, against the replay of its recorded runs:
    the same decisions, runs and scores when the runs were recorded at local.yaml's steps; the same decisions when
    they were recorded longer (a mixture sized for local.yaml's steps has other batches), reported, not failed on."""
    real = screen_corpus(out / f"check-{local['steps']}", first["seed"], first["planted"], first["composition"], {})
    exact = recorded == local["steps"]
    expected, rounds = replay(first, **schedule, **rule, score="runs" if exact else f"steps={local['steps']}")
    decided = {s: d["outcome"] for s, d in real["decisions"].items()} == {s: d.outcome for s, d in expected.items()}
    if exact:  # the same runs, so the same scores to the digit
        same = decided and len(real["runs"]) == sum(rounds) and all(real["runs"][key] == first["runs"][key]
                                                                    for key in real["runs"])
        print(f"\ncheck: draw 0's screen run with local.yaml's adaptive settings: {len(real['runs'])} proxy runs, the same "
              f"decisions, runs and scores as the replay: {same}")
        return same
    # Recorded longer: a mixture sized for local.yaml's steps has other batches, so the same only in distribution.
    dropped = sorted(s for s, d in real["decisions"].items() if d["outcome"] == "drop")
    print(f"\ncheck: draw 0's screen run with local.yaml's adaptive settings ({local['steps']} steps): "
          f"{len(real['runs'])} proxy runs (the replay of the recorded runs' first {local['steps']} steps: "
          f"{sum(rounds)}); the same decisions: {decided}; dropped {dropped}")
    return True


def power(args) -> int:
    import yaml

    from corpus.config import OPT_PILE_SUBSETS
    from screen.config import ScreenConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["screen"]
    rule = {"ratio": local["ratio"], "alpha": local["alpha"]}
    schedule = {"seeds": local["seeds"], "max_seeds": local["max_seeds"], "slots": local["concurrent_runs"]}
    recorded = args.record_steps or local["steps"]
    prefixes = tuple(sorted(set((args.steps or []) + [local["steps"]])))
    if max(prefixes) > recorded or min(prefixes) < ScreenConfig().burn_in + 4:
        raise SystemExit(f"--steps {prefixes}: each must be within the recorded runs' {recorded} steps and at least "
                         f"burn_in + 4 = {ScreenConfig().burn_in + 4}")
    if args.max_seeds < local["max_seeds"]:
        raise SystemExit(f"--max-seeds {args.max_seeds}: the replays need every seed local.yaml's rule may ask for, "
                         f"at least its max_seeds = {local['max_seeds']}")
    everything = {"seeds": args.max_seeds, "max_seeds": args.max_seeds, "steps": recorded}
    corpora = []
    for k in range(args.draws):
        planted = {OPT_PILE_SUBSETS[(k + j) % len(OPT_PILE_SUBSETS)]: n for j, n in enumerate(STRENGTHS)}
        corpus = screen_corpus(out / f"draw-{k:02d}", 1000 + k, planted, COMPOSITIONS[k % len(COMPOSITIONS)], everything,
                               prefixes)
        corpora.append(corpus)
        print(f"draw {k}: {corpus['composition']}, planted {planted}: {corpus['seconds']:.0f} s", file=sys.stderr, flush=True)
    issue = screen_corpus(out / "issue", 0, {"HackerNews": 6}, "no-submissions", everything, prefixes)

    print(f"configs/local.yaml's screen "
          f"({local['steps']} steps of the {local['proxy']['model']} proxy); {args.draws} draws of the sample, "
          f"every mixture run with {args.max_seeds} seeds for {recorded} steps, rules replayed from those runs")
    packed = local["concurrent_runs"] * PACKED_RUNS
    designs = [(f"local.yaml: adaptive, {schedule['slots']} slots a round (its concurrent jobs: one seed a round)", {**schedule, **rule}),
               (f"adaptive, {CLUSTER_CONCURRENT} slots a round (the cluster configs)", {**schedule, **rule, "slots": CLUSTER_CONCURRENT}),
               (f"adaptive, {packed} slots a round (its jobs' packed runs too)", {**schedule, **rule, "slots": packed})]
    designs += [(f"fixed {n} seeds", {"seeds": n, "max_seeds": n, **rule}) for n in range(2, args.max_seeds + 1)]
    designs += [(f"adaptive, ratio {r}", {**schedule, **rule, "ratio": r}) for r in (1.5, 3.0) if r != rule["ratio"]]
    designs += [("local.yaml's, without the composition term", {**schedule, **rule, "score": "unadjusted"}),
                ("before: spike score, margin 15, 2 seeds", {"before": True})]
    if prefixes != (recorded,):
        # A design's rows above score the runs as recorded; these score each run's first n steps.
        designs += [(f"local.yaml's rule on the runs' first {n} steps", {**schedule, **rule, "score": f"steps={n}"})
                    for n in prefixes]
    print("\n| rule | " + " | ".join(f"planted 1 in {n} dropped" for n in STRENGTHS)
          + " | clean dropped | inconclusive | proxy runs per screen | proxy steps per screen | rounds | run times, 8 at a time |")
    print("|---|" + "---|" * (len(STRENGTHS) + 6))
    results = {}
    for name, design in designs:
        t = tally(corpora, **design)
        results[name] = {"rule": design, **t}
        steps = int(design["score"].removeprefix("steps=")) if design.get("score", "").startswith("steps=") else recorded
        print(f"| {name} | " + " | ".join(rate(t["detected"][n]) for n in STRENGTHS)
              + f" | {rate(t['clean_dropped'])} | {t['inconclusive']} | {t['runs'] / len(corpora):.1f} "
              f"| {steps * t['runs'] / len(corpora):,.0f} | {t['rounds'] / len(corpora):.2f} | {t['waves'] / len(corpora):.2f} |")
    for name, found in results.items():
        if found["wrong"]:
            print(f"  {name}: " + "; ".join(found["wrong"]))
    n = noise(corpora)
    print(f"\npaired effects per seed: clean subsets mean {n['clean_mean']:+.3f}, sd {n['clean_sd']:.3f}, largest "
          f"{n['clean_max']:.2f}, largest clean subset's mean {n['clean_subset_means_max']:.2f}; planted subsets' means, "
          + ", ".join(f"1 in {every}: lowest {low:.2f}, mean {mean:.2f}" for every, (low, mean) in n["planted_means"].items())
          + f"; pooled within-subset sd {n['within_sd']:.3f} "
          f"(line ln({rule['ratio']}) = {math.log(rule['ratio']):.2f})")
    for score in ["runs"] + [f"steps={n}" for n in prefixes if (n, recorded) != (recorded, local["steps"])]:
        decisions, rounds = replay(issue, **schedule, **rule, score=score)
        said = "" if score == "runs" else f" on the runs' first {score.removeprefix('steps=')} steps"
        print(f"\nthe issue's corpus (seed 0, HackerNews 1 in 6, Reddit comments only), local.yaml's rule{said}: "
              f"{sum(rounds)} proxy runs; " + "; ".join(f"{s} {d.outcome} {math.exp(d.effect):.2f}x" for s, d in sorted(decisions.items())))
    print("clean subsets' mean roughness over the baseline's (x), where clean: "
          + "; ".join(f"{s} {v}x" for s, v in n["clean_by_subset"].items())
          + "\n  the same without the composition term: "
          + "; ".join(f"{s} {v}x" for s, v in noise(corpora, "unadjusted")["clean_by_subset"].items()))
    results["noise"] = n
    ok = check(out, corpora[0], local, schedule, rule, recorded) if args.check else True
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    """The command line, built without running anything (tests/test_doc_commands.py checks the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cost", help="the screen's seconds, packed into jobs or one job per run")
    c.add_argument("--out", default="/tmp/bench_screen")
    w = sub.add_parser("power", help="detection and false-drop rates over many corpus draws")
    w.add_argument("--draws", type=int, default=12)
    w.add_argument("--max-seeds", type=int, default=6)
    w.add_argument("--record-steps", type=int, help="steps of every recorded proxy run (default: local.yaml's)")
    w.add_argument("--steps", type=lambda text: [int(n) for n in text.split(",")],
                   help="replay local.yaml's rule on the runs' first n steps, for each n (comma-separated)")
    w.add_argument("--out", default="/tmp/bench_screen_power")
    w.add_argument("--no-check", dest="check", action="store_false", help="skip the real adaptive screen of draw 0")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(provenance.header(), flush=True)
    return cost(args) if args.command == "cost" else power(args)


if __name__ == "__main__":
    raise SystemExit(main())
