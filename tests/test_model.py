"""The OPT model: parity with transformers' OPTForCausalLM, parameter counts, init, monitoring hooks."""

from __future__ import annotations

import contextlib
import json
import math
import re
from functools import partial

import pytest
import torch
from transformers import OPTConfig as HFConfig
from transformers import OPTForCausalLM

from model.configs import CONFIGS, flops_per_token, get, param_count
from model.hf import from_pretrained, hf_config, save_pretrained
from model.opt import OPT


def tiny(pre_ln: bool = True):
    torch.manual_seed(0)
    return OPT(get("tiny").replace(pre_ln=pre_ln)).eval()


@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre-LN", "post-LN"])
def test_exported_model_gives_the_same_logits_and_loss_in_transformers(tmp_path, pre_ln):
    ours = tiny(pre_ln)
    save_pretrained(ours, tmp_path)
    theirs = OPTForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, ours.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5
        ours_loss = ours(ids[:, :-1], ids[:, 1:])
        assert ours_loss.item() == pytest.approx(theirs(ids, labels=ids).loss.item(), abs=1e-5)
    assert (from_pretrained(tmp_path).eval()(ids) - ours(ids)).abs().max().item() == 0.0


def test_a_big_export_is_sharded_with_an_index_and_labels_its_dtype(tmp_path):
    """Files of at most max_shard_bytes (here 200 kB, so the tiny model takes several), named and indexed
    as transformers names them, written one piece at a time; fp16 weights say float16."""
    from model.hf import INDEX

    ours = tiny().half()
    pieces = []
    save_pretrained(ours, tmp_path, max_shard_bytes=200_000,
                    gather=lambda part: pieces.append(type(part).__name__) or contextlib.nullcontext())
    assert pieces == ["TokenEmbedding", "Embedding", "Block", "Block", "LayerNorm"]  # gathered one at a time
    index = json.loads((tmp_path / INDEX).read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(set(index["weight_map"].values()))
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    assert all((tmp_path / f).stat().st_size <= 200_000 + 10_000 for f in files)  # + the safetensors header
    assert set(index["weight_map"]) == {"model." + k for k in ours.state_dict()}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ours.state_dict().values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"
    theirs = OPTForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.dtype == torch.float16
    ids = torch.randint(0, ours.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    back = from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.float().state_dict().values()))
    with torch.no_grad():
        assert (theirs.float()(ids).logits - back.eval()(ids)).abs().max().item() < 1e-5


def test_a_model_made_by_transformers_imports_with_the_same_logits(tmp_path):
    torch.manual_seed(3)
    cfg = HFConfig(vocab_size=300, hidden_size=32, num_hidden_layers=3, ffn_dim=128, num_attention_heads=4,
                   max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=True)
    theirs = OPTForCausalLM(cfg).eval()
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5


def test_projected_embeddings_are_refused_with_a_reason(tmp_path):
    cfg = HFConfig(vocab_size=100, hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=1, ffn_dim=128,
                   num_attention_heads=4, max_position_embeddings=16)
    OPTForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="word_embed_proj_dim 16"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "tiny"])
def test_parameter_counts_match_transformers_built_on_meta(name):
    config = get(name)
    hf = hf_config(config)
    with torch.device("meta"):
        model = OPTForCausalLM(HFConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}))
    assert param_count(config) == sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert flops_per_token(config) > 6 * param_count(config) - 6 * (config.max_seq_len + 2) * config.d_model


def test_175b_is_175b():
    assert abs(param_count(get("175b")) / 175e9 - 1) < 0.005
    with pytest.raises(KeyError, match="unknown OPT size '7b'"):
        get("7b")


def test_125m_init_follows_opts_rule():
    torch.manual_seed(0)
    model = OPT(get("125m"))
    out_std = 0.006 / math.sqrt(2 * 12)
    for name, p in model.named_parameters():
        if "layer_norm" in name:
            assert (p == (1.0 if name.endswith("weight") else 0.0)).all(), name
        elif name.endswith("bias"):
            assert (p == 0).all(), name
        else:
            expected = out_std if name.endswith(("out_proj.weight", "fc2.weight")) else 0.006
            assert p.std().item() == pytest.approx(expected, rel=0.02), name
            assert abs(p.mean().item()) < expected / 20, name


def test_monitoring_hooks_and_activation_checkpointing():
    model = tiny().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert model.last_activation_norm.item() > 0
    norms = model.block_grad_norms()
    assert len(norms) == model.config.n_layer and all(n > 0 for n in norms)
    grads = [p.grad.clone() for p in model.parameters()]
    checkpointed = OPT(model.config.replace(activation_checkpointing=True)).train()
    checkpointed.load_state_dict(model.state_dict())
    torch.manual_seed(5)  # the same dropout masks
    checkpointed(ids[:, :-1], ids[:, 1:]).backward()
    for g, p in zip(grads, checkpointed.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    with pytest.raises(ValueError, match="at most 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_tokenizer_is_exported_beside_the_weights(tmp_path):
    from transformers import AutoTokenizer

    from corpus import tokenizer

    tok = tokenizer.train(["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=300)
    save_pretrained(tiny(), tmp_path, save_tokenizer=partial(tokenizer.save, tok))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 1
    assert loaded.encode("the lazy dog", add_special_tokens=False) == tok.encode("the lazy dog").ids


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_blockwise_loss_is_the_linear_layer_then_cross_entropy(monkeypatch, dtype, tolerance):
    """model/loss.py against F.linear then F.cross_entropy: the loss, the gradients of the input (through the
    layer below it) and of the tied weight, with blocks that do not divide the rows, ignored (-100) targets
    left out of the mean, and the same loss without gradients (evaluation)."""
    import torch.nn.functional as F

    from model import loss

    monkeypatch.setitem(loss.BLOCK_BYTES, "cpu", 7 * 4 * 96)  # 7 rows a block: 37 rows in 6 blocks, the last short
    gen = torch.Generator().manual_seed(0)
    below = torch.nn.Linear(16, 16).to(dtype)
    weight = torch.randn(96, 16, generator=gen).to(dtype).requires_grad_()
    h = torch.randn(37, 16, generator=gen).to(dtype)
    targets = torch.randint(0, 96, (37,), generator=gen)
    targets[[3, 20]] = -100

    def grads(fn):
        below.zero_grad()
        weight.grad = None
        value = fn(below(h), weight, targets)
        value.backward()
        return value.detach().float(), below.weight.grad.float().clone(), weight.grad.float().clone()

    ours = grads(loss.linear_cross_entropy)
    torch_own = grads(lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t))
    for a, b in zip(ours, torch_own):
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item()), (a - b).abs().max()
    asked, blocks = [], loss._blocks
    monkeypatch.setattr(loss, "_blocks", lambda *args: asked.append(args[3:]) or blocks(*args))
    with torch.no_grad():  # evaluation: the loss alone, no gradient computed
        assert torch.allclose(loss.linear_cross_entropy(below(h), weight, targets).float(), torch_own[0], rtol=tolerance)
    assert asked == [(False, False)]
    wrong = targets.clone()
    wrong[0] = (targets[0] + 1) % 96
    assert not torch.allclose(grads(lambda x, w, t: loss.linear_cross_entropy(x, w, wrong))[2], ours[2])


def test_the_blockwise_loss_under_fp16_keeps_small_gradients_for_the_loss_scale(torch_fp16):
    """Under fp16 the gradients are kept in fp32 until backward applies the loss scale: a 4,096-token vocabulary's
    per-logit gradients (about 1e-8 here) are under fp16's smallest value unscaled, and would come back as zeros."""
    from model import loss

    gen = torch.Generator().manual_seed(1)
    x32, w32 = torch.randn(512, 16, generator=gen), torch.randn(4096, 16, generator=gen) * 0.01
    targets = torch.randint(0, 4096, (512,), generator=gen)
    x = x32.half().requires_grad_()
    (loss.linear_cross_entropy(x, w32.half(), targets) * 2.0 ** 16).backward()
    reference = x32.clone().requires_grad_()
    (loss.linear_cross_entropy(reference, w32, targets) * 2.0 ** 16).backward()
    assert x.grad.dtype == torch.float16 and (x.grad != 0).float().mean() > 0.99
    torch.testing.assert_close(x.grad.float(), reference.grad, rtol=2e-2, atol=1e-3 * reference.grad.abs().max().item())
