"""Hugging Face format: a folder `transformers.OPTForCausalLM.from_pretrained` loads, and back.

Export writes config.json (an OPTConfig, written as JSON: transformers is not needed to export,
labelled with the dtype the weights are stored in) and the weights with OPT's parameter names
("model." + ours; the output layer is tied, so only the embeddings are stored) in safetensors
files of at most `max_shard_bytes`, as transformers writes big models: `model.safetensors` when
one file holds them all, else `model-0000i-of-0000N.safetensors` and the
`model.safetensors.index.json` that maps each tensor to its file. The model is written one piece
at a time (the embeddings, each block, the final LayerNorm: `export_parts`), so a caller whose
parameters are partitioned (ZeRO-3) gathers one block at a time, and the writer holds at most
one file's tensors in host memory. `save_tokenizer(folder)`, when given, writes the tokenizer's files
beside the weights (corpus.tokenizer.save: tokenizer.json with OPT's special tokens), so that
`AutoTokenizer.from_pretrained` works on the same folder; this module imports nothing of the stages. Import reads such a folder (ours, or a released OPT checkpoint on local disk).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch
from safetensors.torch import load_file, save_file

from model.configs import OPTConfig
from model.opt import OPT, POSITION_OFFSET

PREFIX = "model."
SHARD_BYTES = 5 << 30  # the most one weights file holds (transformers' default max_shard_size, 5 GB)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def hf_config(config: OPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    return {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "torch_dtype": str(dtype).removeprefix("torch."),
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "word_embed_proj_dim": config.d_model,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head, "ffn_dim": config.ffn_dim,
        "max_position_embeddings": config.max_seq_len, "do_layer_norm_before": config.pre_ln,
        "dropout": config.dropout, "attention_dropout": config.attn_dropout, "activation_function": "relu",
        "init_std": config.init_std, "layerdrop": 0.0, "enable_bias": True, "layer_norm_elementwise_affine": True,
        "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "tie_word_embeddings": True,
        "opt_pipeline_name": config.name,
    }


def export_parts(model: OPT) -> Iterator[torch.nn.Module]:
    """The pieces export gathers and writes one at a time: the embeddings, each block, the final LayerNorm."""
    d = model.decoder
    yield from (d.embed_tokens, d.embed_positions, *d.layers)
    if d.final_layer_norm is not None:
        yield d.final_layer_norm


def shard_plan(tensors: list[tuple[str, int, object]], max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """The files `tensors` (name, bytes, group) go into, in order, as WeightsWriter fills them, and a new file
    wherever the group changes: a file holds one group's tensors, so that the groups' owners (a pipeline's
    stages) each write their own files at once."""
    files: list[list[str]] = []
    size, last = 0, None
    for name, nbytes, group in tensors:
        if not files or group != last or _starts_file(size, nbytes, max_bytes):
            files.append([])
            size = 0
        files[-1].append(name)
        size, last = size + nbytes, group
    return files


def file_names(n: int) -> list[str]:
    """The names transformers gives `n` weights files."""
    return [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_metadata(out: Path, config: OPTConfig, dtype: torch.dtype, weight_map: dict[str, str], total_bytes: int,
                   save_tokenizer: Callable[[Path], object] | None = None) -> None:
    """Beside weights files already written: the index (none, and a stale one removed, when one file holds
    them all), config.json and, when given, the tokenizer's files."""
    if len(set(weight_map.values())) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
                                            indent=2) + "\n")
    else:
        (out / INDEX).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2) + "\n")
    if save_tokenizer is not None:
        save_tokenizer(out)


def _starts_file(pending_bytes: int, size: int, max_bytes: int) -> bool:
    return pending_bytes > 0 and pending_bytes + size > max_bytes


class WeightsWriter:
    """Tensors appended a piece at a time into safetensors files of at most `max_bytes` (a single tensor
    larger than that gets a file of its own), named and indexed as transformers names and indexes them."""

    def __init__(self, out: Path, max_bytes: int = SHARD_BYTES):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.total_bytes = 0, 0
        self.files: list[tuple[Path, list[str]]] = []  # written so far, under temporary names
        self.dtypes: set[torch.dtype] = set()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if _starts_file(self.pending_bytes, size, self.max_bytes):
                self._flush()
            self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()  # a copy: ZeRO-3 frees the gathered data
            self.pending_bytes += size
            self.total_bytes += size
            self.dtypes.add(tensor.dtype)

    def _flush(self) -> None:
        path = self.out / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> tuple[torch.dtype, dict[str, str]]:
        """The files under their final names; the weights' dtype and which file holds each tensor."""
        if self.pending or not self.files:
            self._flush()
        if len(self.dtypes) > 1:
            raise ValueError(f"the weights are of several dtypes {sorted(map(str, self.dtypes))}: one config cannot say which")
        weight_map = {}
        for (path, names), final in zip(self.files, file_names(len(self.files))):
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        return next(iter(self.dtypes), torch.float32), weight_map


def save_pretrained(model: OPT, out_dir: str | Path, save_tokenizer: Callable[[Path], object] | None = None, *,
                    gather: Callable[[torch.nn.Module], ContextManager] | None = None, write: bool = True,
                    max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `model` as a Hugging Face folder. Under ZeRO-3 every rank calls this, with `gather` making one
    piece's parameters whole (a collective) and `write` true on one rank only."""
    out = Path(out_dir)
    writer = None
    if write:
        out.mkdir(parents=True, exist_ok=True)
        writer = WeightsWriter(out, max_shard_bytes)
    names = {id(p): name for name, p in model.named_parameters()}
    for part in export_parts(model):
        with (gather or (lambda _: contextlib.nullcontext()))(part):
            if writer is not None:
                writer.add({PREFIX + names[id(p)]: p for p in part.parameters()})
    if writer is not None:
        dtype, weight_map = writer.close()
        write_metadata(out, model.config, dtype, weight_map, writer.total_bytes, save_tokenizer)
    return out


def from_pretrained(path: str | Path) -> OPT:
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    if hf.get("word_embed_proj_dim", hf["hidden_size"]) != hf["hidden_size"]:
        raise ValueError(f"{path}: word_embed_proj_dim {hf['word_embed_proj_dim']} != hidden_size (the released "
                         "350M's projected embeddings are not supported)")
    config = OPTConfig(name=hf.get("opt_pipeline_name", path.name), n_layer=hf["num_hidden_layers"],
                       n_head=hf["num_attention_heads"], d_model=hf["hidden_size"], lr=0.0, batch_tokens=0,
                       vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
                       pre_ln=hf.get("do_layer_norm_before", True), dropout=hf.get("dropout", 0.1),
                       attn_dropout=hf.get("attention_dropout", 0.0), init_std=hf.get("init_std", 0.006))
    if hf.get("ffn_dim", 4 * config.d_model) != config.ffn_dim:
        raise ValueError(f"{path}: ffn_dim {hf['ffn_dim']} is not 4 * hidden_size")
    index = path / INDEX
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    state = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
    model = OPT(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match an OPT of this config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    assert expected["decoder.embed_positions.weight"].shape[0] == config.max_seq_len + POSITION_OFFSET
    model.load_state_dict(state)
    return model
