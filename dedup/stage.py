"""The dedup stage: the training documents that overlap the evaluation set removed, then near-duplicates
(Jaccard >= threshold) removed across every source, on Ray Data, without the corpus's text in any shuffle, each
phase a module of its own:

0. dedup/decontaminate.py: every document whose word n-grams overlap an evaluation document's (corpus/evalset.py,
   set aside by normalize) goes to `near_eval/`, by `eval.decontaminate`'s settings and no dedup.* one; the
   phases below never see it, so what it removes does not depend on which duplicates they remove.
1. dedup/exact.py: exact duplicates, by a 128-bit hash of each text; everything below sees one document per text.
2. dedup/candidates.py: MinHash band keys of each part's documents, then the candidate pairs of each bucket.
3. dedup/verify.py: each pair's exact Jaccard, with the shingle sets of the documents it needs sent to the task
   that verifies it, never the text. Every checked pair is kept in `candidates/`.
4. dedup/components.py: the components of the graph of verified pairs and exact copies.
5. dedup/assemble.py: each component's kept document; every other one to `duplicates/`.
6. dedup/output.py: each part of normalize's output without its removed rows (either reason's).

A document's key is its place in normalize's parts (dedup/keys.py). The stage is keyed on the `eval` section as
well as its own: the decontamination's settings are there. rows_in = rows_out + duplicate + near_eval.
"""

from __future__ import annotations

import gc
import shutil

from core.console import Bar
from core.dag import StageContext, StageResult
from corpus import evalset
from corpus.parts import aside_parts, check_read, check_written, input_parts
from dedup.assemble import DUPLICATE, FOLDER, assemble
from dedup.candidates import find_candidates
from dedup.config import DedupConfig
from dedup.decontaminate import decontaminate
from dedup.exact import find_exact
from dedup.keys import Inputs, Shuffles
from dedup.lsh import choose_banding
from dedup.metrics import stage_metrics
from dedup.output import write_output
from dedup.verify import verify_candidates


def phase_done(bar: Bar, to: int | None = None) -> None:
    """A phase's Ray datasets are garbage once it returns, but held in reference cycles until Python's cyclic
    collector runs, which may be phases later: with them their blocks in the object store and, in the driver, the
    specification of every task that made a block (Ray keeps it to rebuild a lost block). Collected as each phase
    ends, the driver's peak over dedup was 6-7 MB lower at 0.15M and 0.6M documents (issue #61)."""
    gc.collect()
    if to is None:
        bar.update()
    else:
        bar.update_to(to)


def run(ctx: StageContext) -> StageResult:
    cfg: DedupConfig = ctx.section
    bands, rows = (cfg.bands, cfg.rows) if cfg.bands else choose_banding(cfg.num_perm, cfg.threshold)
    inputs = Inputs.of(input_parts(ctx.inputs, "normalize"), ctx.folder / "work")
    if not inputs.parts:  # normalize kept nothing
        return StageResult(0, 0, {DUPLICATE: 0, evalset.NEAR: 0})
    priority = {s.name: i for i, s in enumerate(ctx.config.sources)}
    held: dict[str, int] = {}  # the most rows of one key (a text, a bucket) that one task of a phase grouped
    shuffles, folders = Shuffles(ctx.config.ray), {DUPLICATE: str(ctx.aside(FOLDER)), evalset.NEAR: str(ctx.aside(evalset.NEAR))}
    # decontamination; exact; candidates; candidate documents and verification; components; output
    with Bar("dedup", "phases", 7) as bar:
        near = decontaminate(inputs.parts, aside_parts(ctx.inputs, "normalize", evalset.REASON), ctx.config.eval.decontaminate,
                             folders[evalset.NEAR], inputs.decontaminated)
        phase_done(bar)
        exact, exact_rows, held["exact"] = find_exact(inputs, priority, shuffles, cfg.task_documents)
        phase_done(bar)
        pairs, held["candidates"] = find_candidates(inputs, cfg, bands, rows, exact_rows, shuffles)
        phase_done(bar)
        verified = verify_candidates(inputs, pairs, cfg, shuffles, ctx.aside("candidates"))
        phase_done(bar, 5)
        found, removed = assemble(inputs, ctx.aside("candidates"), exact, cfg.threshold, cfg.task_documents, priority, shuffles,
                                  folders[DUPLICATE])
        phase_done(bar)
        counts = write_output(inputs, {DUPLICATE: removed, evalset.NEAR: str(inputs.decontaminated)}, ctx.output)
        phase_done(bar)
    check_written(folders[DUPLICATE], counts[DUPLICATE], "duplicates removed")
    check_written(folders[evalset.NEAR], counts[evalset.NEAR], "documents that overlap the evaluation set removed")
    check_written(ctx.output, counts["rows_out"], "documents kept")
    check_read(counts["rows_in"], ctx.inputs, "normalize")
    shutil.rmtree(inputs.work, ignore_errors=True)
    found.update({**verified, **{f"largest_key_rows.{k}": n for k, n in held.items()}})
    metrics = {**stage_metrics(found, shuffles.moved, counts["rows_in"], bands, rows, ctx), **near}
    return StageResult(counts["rows_in"], counts["rows_out"], {DUPLICATE: counts[DUPLICATE], evalset.NEAR: counts[evalset.NEAR]},
                       metrics, fields={"eval": ctx.inputs["normalize"].get("eval")})
