"""``export`` writes the layout Hugging Face's ``save_pretrained`` writes: a tied weight
once (the loader ties it again), and ``config.json`` when the checkpoint carries the
model's config; ``from_pretrained`` then loads the export as it loads save_pretrained's."""

from __future__ import annotations

import json

import pytest
import torch

import safeckpt
from safeckpt.interop.export import export_checkpoint

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")


def tiny_gpt2() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("where", ["state", "metadata"])
def test_export_matches_save_pretrained(tmp_path, where):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    model.save_pretrained(tmp_path / "hf")
    theirs = st.load_file(tmp_path / "hf" / "model.safetensors")

    config = model.config.to_dict()
    state = {"model": model, "step": 3} | ({"config": config} if where == "state" else {})
    safeckpt.save(state, tmp_path / "ckpt", metadata={"config": config} if where == "metadata" else None)
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", select="model.", strip_prefix=True)

    ours = st.load_file(tmp_path / "out" / "model.safetensors")
    assert set(ours) == set(theirs) and len(ours) == len(model.state_dict()) - 1  # lm_head.weight once
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(json.dumps(config))
    def loaded_config(folder: str) -> dict:
        return transformers.AutoConfig.from_pretrained(tmp_path / folder).to_dict() | {"_name_or_path": ""}
    assert loaded_config("out") == loaded_config("hf")
    assert "config.json" in [p.rsplit("/", 1)[1] for p in result.paths]

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_sharded_export_of_tied_weights_and_no_config_for_one_file(tmp_path):
    model = tiny_gpt2()
    safeckpt.save({"model": model, "config": model.config.to_dict()}, tmp_path / "ckpt")
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "sharded", select="model.", strip_prefix=True,
                               max_shard_size="2KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    assert (tmp_path / "sharded" / "config.json").exists() and len(result.files) > 1
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "sharded")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)

    one = export_checkpoint(tmp_path / "ckpt", tmp_path / "weights.safetensors", select="model.",
                            strip_prefix=True)  # one file: nowhere to put a config
    assert not (tmp_path / "config.json").exists() and len(one.paths) == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(safeckpt.CheckpointExistsError, match="config.json"):  # never replaced unasked
        export_checkpoint(tmp_path / "ckpt", tmp_path / "mine", select="model.", strip_prefix=True)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["config.json"]
    export_checkpoint(tmp_path / "ckpt", tmp_path / "mine", select="model.", strip_prefix=True, overwrite=True)
    assert json.loads((tmp_path / "mine" / "config.json").read_text())["n_embd"] == 8
