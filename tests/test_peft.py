"""PEFT interop on a tiny random Qwen3: our LoRA adapters load in transformers + peft and PEFT's load in ours,
with logits equal within 1e-4 both ways; merged full weights equal too; ``retrojax generate --adapter`` gives
HF + PEFT's greedy tokens."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from retrojax.model.checkpoint import from_pretrained
from retrojax.model.lora import apply_lora, for_decoding, is_lora, merge_lora
from retrojax.model.peft import AdapterError, load_peft_adapter, save_peft_adapter, save_policy

# peft (a declared test dependency) is imported inside the tests, not here: it pulls in torch and
# transformers (~6 s), which every test worker would otherwise pay while collecting the suite

IDS = np.random.default_rng(3).integers(0, 1000, (2, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("peft"), seed=7)


def _hf(base_dir, adapter_dir=None):
    import peft
    import torch
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    return model


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def _randomize_b(model, seed=0, scale=0.05):
    for i, t in enumerate(model.layers.targets):
        var = getattr(model.layers, f"{t}_lora_b")
        var.set_value(scale * jax.random.normal(jax.random.PRNGKey(seed + i), var.shape, var.dtype))


def test_our_adapter_loads_in_peft_with_equal_logits(base, tmp_path):
    ours = apply_lora(from_pretrained(base), rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"),
                      seed=1)
    _randomize_b(ours)
    save_peft_adapter(ours, tmp_path / "ad", base=str(base))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == sorted(["q_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "down_proj"])
    theirs = _hf_logits(_hf(base, tmp_path / "ad"), IDS)
    mine = np.asarray(ours(jnp.asarray(IDS)))
    assert np.abs(theirs - _hf_logits(_hf(base), IDS)).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)


def test_peft_made_adapter_loads_in_ours_with_equal_logits(base, tmp_path):
    import peft
    import torch

    hf = _hf(base)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "up_proj", "down_proj"],
                          init_lora_weights=False, use_rslora=True, layers_to_transform=[1],
                          task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    pm.save_pretrained(tmp_path / "ad")
    theirs = _hf_logits(pm.eval(), IDS)
    ours = load_peft_adapter(from_pretrained(base), tmp_path / "ad")
    assert is_lora(ours) and ours.layers.targets == ("q", "k", "up", "down")
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(IDS))), theirs, atol=1e-4, rtol=0)
    # layer 0 was not adapted: its adapters are zero
    assert float(jnp.abs(ours.layers.q_lora_b[...][0]).max()) == 0.0


def test_merged_full_weights_equal_base_plus_adapter(base, tmp_path):
    ours = apply_lora(from_pretrained(base), rank=4, alpha=16.0, seed=2)
    _randomize_b(ours, seed=5)
    save_policy(ours, tmp_path / "policy", base=str(base), merged=True)
    assert (tmp_path / "policy" / "adapter_model.safetensors").exists()
    merged = _hf_logits(_hf(tmp_path / "policy" / "merged"), IDS)
    np.testing.assert_allclose(merged, _hf_logits(_hf(base, tmp_path / "policy"), IDS), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(merge_lora(ours)(jnp.asarray(IDS))), merged, atol=1e-4, rtol=0)


def test_generate_with_adapter_matches_hf_peft_greedy(base, tmp_path, capsys):
    import torch

    from retrojax.cli import main as cli
    from retrojax.generate import reply
    from retrojax.model.tokenizer import load_tokenizer, train_sentencepiece

    train_sentencepiece(["push the box to the goal", "move left then up", "<action>up</action>"] * 30, 400,
                        base)
    ours = apply_lora(from_pretrained(base), rank=4, alpha=8.0, seed=3)
    _randomize_b(ours, seed=9, scale=0.2)
    save_peft_adapter(ours, tmp_path / "ad", base=str(base))
    rc = cli(["generate", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--prompt", "push the box",
              "--max-new-tokens", "8"])
    assert rc == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(base)
    out = reply(for_decoding(load_peft_adapter(from_pretrained(base), tmp_path / "ad")), tok, "push the box",
                max_new_tokens=8)
    assert printed == out.text + "\n"
    prompt = tok.encode_chat([{"role": "user", "content": "push the box"}])
    hf = _hf(base, tmp_path / "ad")
    with torch.no_grad():
        gen = hf.generate(torch.as_tensor([prompt]), max_new_tokens=out.ids.size, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(out.ids, gen[0, len(prompt):].numpy())


def test_bad_adapters_are_refused_with_reasons(base, tmp_path):
    ad = tmp_path / "ad"
    ad.mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter(from_pretrained(base), ad)
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                        "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        load_peft_adapter(from_pretrained(base), ad)
    ours = apply_lora(from_pretrained(base), rank=4, alpha=8.0)
    save_peft_adapter(ours, ad)
    with pytest.raises(AdapterError, match="r=2"):
        cfg = json.loads((ad / "adapter_config.json").read_text())
        (ad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
        load_peft_adapter(from_pretrained(base), ad)
