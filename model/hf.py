"""Hugging Face format: a folder `transformers.OPTForCausalLM.from_pretrained` loads, and back.

Export writes config.json (an OPTConfig, written as JSON: transformers is not needed to export)
and model.safetensors with OPT's parameter names ("model." + ours; the output layer is tied, so
only the embeddings are stored), plus the tokenizer when given (a `tokenizers.Tokenizer`,
saved as tokenizer.json with OPT's special tokens) so that `AutoTokenizer.from_pretrained` works
on the same folder. Import reads such a folder (ours, or a released OPT checkpoint on local disk).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from corpus import tokenizer as tokenizers
from model.configs import OPTConfig
from model.opt import OPT, POSITION_OFFSET

PREFIX = "model."


def hf_config(config: OPTConfig) -> dict:
    return {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "torch_dtype": "float32",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "word_embed_proj_dim": config.d_model,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head, "ffn_dim": config.ffn_dim,
        "max_position_embeddings": config.max_seq_len, "do_layer_norm_before": config.pre_ln,
        "dropout": config.dropout, "attention_dropout": config.attn_dropout, "activation_function": "relu",
        "init_std": config.init_std, "layerdrop": 0.0, "enable_bias": True, "layer_norm_elementwise_affine": True,
        "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "tie_word_embeddings": True,
        "opt_pipeline_name": config.name,
    }


def save_pretrained(model: OPT, out_dir: str | Path, tokenizer=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    tensors = {PREFIX + k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizers.save(tokenizer, out)
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
    files = sorted(path.glob("*.safetensors"))
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
