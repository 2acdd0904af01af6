"""The final weights as a Hugging Face folder, with the tokenizer the shards were made with."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from train.loop.config import LoopConfig
from train.loop.context import Context
from train.parallel import pipeline
from train.parallel.groups import full_state_dict

log = logging.getLogger("train")


def export(engine, model, cfg: LoopConfig, ctx: Context) -> None:
    """One piece of the model at a time (embeddings, each block, the final LayerNorm) is gathered on every
    rank (under ZeRO-3; a block of 175B is 3.6 GB in fp16) and written by rank 0 into safetensors files
    of at most 5 GB, so neither a GPU nor rank 0's host ever holds the whole model. A tensor-parallel
    model (ZeRO 0-2, built whole in the first place) is gathered whole by rank 0's tensor group, the one
    replica that writes; a pipeline's stages write their own pieces (train/parallel/pipeline.py export_model)."""
    import deepspeed

    from corpus import tokenizer
    from model.hf import save_pretrained
    from model.opt import OPT

    tok = None
    tok_path = Path(cfg.shards) / tokenizer.FILE
    if ctx.leader:
        if tok_path.is_file():
            tok = tokenizer.load(str(tok_path))
        else:
            log.warning("%s is missing: the model is exported without a tokenizer", tok_path)
    save_tokenizer = None if tok is None else partial(tokenizer.save, tok)
    save = partial(save_pretrained, out_dir=cfg.export_dir, save_tokenizer=save_tokenizer)

    if ctx.pipelined:
        pipeline.export_model(engine.module, ctx.groups, cfg.architecture, cfg.export_dir, save_tokenizer)
        return
    if ctx.groups:
        if ctx.data_rank != 0:  # the other replicas hold the same weights
            return
        whole = full_state_dict(model, ctx.groups)
        if ctx.leader:
            unsplit = OPT(cfg.architecture)
            unsplit.load_state_dict(whole)
            save(unsplit)
        return

    def gather(part):
        return deepspeed.zero.GatheredParameters(list(part.parameters()), modifier_rank=None)

    save(model, gather=gather, write=ctx.leader)
