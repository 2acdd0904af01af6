"""The dedup stage: near-duplicates (Jaccard >= threshold) removed across every source, on Ray Data,
without the corpus's text in any shuffle, each phase a module of its own:

1. dedup/exact.py: exact duplicates, by a 128-bit hash of each text; everything below sees one document per text.
2. dedup/candidates.py: MinHash band keys of each part's documents, then the candidate pairs of each bucket.
3. dedup/verify.py: each pair's exact Jaccard, with the shingle sets of the documents it needs sent to the task
   that verifies it, never the text. Every checked pair is kept in `candidates/`.
4. dedup/components.py: the components of the graph of verified pairs and exact copies.
5. dedup/assemble.py: each component's kept document; every other one to `duplicates/` or `near_eval/`.
6. dedup/output.py: each part of normalize's output without its removed rows.

A document's key is its place in normalize's parts (dedup/keys.py). The evaluation set (corpus/evalset.py, set
aside by normalize) takes part as parts of its own, after normalize's: its documents are preferred over any
other as a text's kept copy and as a component's kept document, and are never removed. Only normalize's parts
are written to the output.
"""

from __future__ import annotations

import shutil

from core.console import Bar
from core.dag import StageContext, StageResult
from corpus import evalset
from corpus.parts import aside_parts, check_read, check_written, input_parts
from dedup.assemble import DUPLICATE, FOLDERS, assemble
from dedup.candidates import find_candidates
from dedup.config import DedupConfig
from dedup.exact import find_exact
from dedup.keys import Inputs, Shuffles
from dedup.lsh import choose_banding
from dedup.metrics import stage_metrics
from dedup.output import write_output
from dedup.verify import verify_candidates


def run(ctx: StageContext) -> StageResult:
    cfg: DedupConfig = ctx.section
    bands, rows = (cfg.bands, cfg.rows) if cfg.bands else choose_banding(cfg.num_perm, cfg.threshold)
    training = input_parts(ctx.inputs, "normalize")
    if not training:  # normalize kept nothing
        return StageResult(0, 0, {DUPLICATE: 0, evalset.NEAR: 0})
    inputs = Inputs.of(training + aside_parts(ctx.inputs, "normalize", evalset.REASON), len(training), ctx.folder / "work")
    priority = {s.name: i for i, s in enumerate(ctx.config.sources)}
    shuffles, folders = Shuffles(ctx.config.ray), {reason: str(ctx.aside(folder)) for reason, folder in FOLDERS.items()}
    with Bar("dedup", "phases", 6) as bar:  # exact; candidates; candidate documents and verification; components; output
        exact, exact_rows = find_exact(inputs, priority, shuffles)
        bar.update()
        pairs = find_candidates(inputs, cfg, bands, rows, exact_rows, shuffles)
        bar.update()
        verified = verify_candidates(inputs, pairs, cfg, shuffles, ctx.aside("candidates"))
        bar.update_to(4)
        found, removed = assemble(inputs, ctx.aside("candidates"), exact, cfg.threshold, cfg.task_documents, priority, shuffles,
                                  folders)
        bar.update()
        counts = write_output(inputs, removed, ctx.output)
        bar.update()
    check_written(folders[DUPLICATE], counts[DUPLICATE], "duplicates removed")
    check_written(folders[evalset.NEAR], counts[evalset.NEAR], "near-duplicates of the evaluation set removed")
    check_written(ctx.output, counts["rows_out"], "documents kept")
    check_read(counts["rows_in"], ctx.inputs, "normalize")
    shutil.rmtree(inputs.work, ignore_errors=True)
    metrics = stage_metrics({**found, **verified}, shuffles.moved, counts["rows_in"], bands, rows, ctx)
    return StageResult(counts["rows_in"], counts["rows_out"], {DUPLICATE: counts[DUPLICATE], evalset.NEAR: counts[evalset.NEAR]},
                       metrics, fields={"eval": ctx.inputs["normalize"].get("eval")})
