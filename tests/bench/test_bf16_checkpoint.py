"""bf16_checkpoint's folders are Hub-style bf16 checkpoints: transformers reads them as written
(every tensor bfloat16, in shards with their index), and tokenmill serves them in place."""

import json

import torch

from tokenmill.bench import bf16_checkpoint
from tokenmill.bench.bf16_checkpoint import measure, write_bf16_folder


def test_the_folder_is_a_sharded_bf16_checkpoint_that_serves(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(bf16_checkpoint, "SHARD_BYTES", 100_000)  # several shards
    folder = write_bf16_folder("tiny", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    assert set(index["weight_map"]) == set(hf.state_dict()) - {"lm_head.weight"}  # tied
    result = measure(str(folder), prompt_len=8, decode_len=4, batch=2)
    assert result["decode_tok_s"] > 0 and result["batch_tok_s"] > 0 and result["load_s"] > 0
