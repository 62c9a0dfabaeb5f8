"""The names of an MoE checkpoint's expert matrices, mapped to FusedMoE's shards (a leaf
module: the layer, the models and quantization/gguf_experts.py read the one table).
"""

from __future__ import annotations

import re

# Checkpoint names of one expert's matrices → our shard names (Mixtral's w1 / w3 / w2 and the
# gate / up / down names of Qwen-MoE, OLMoE and most later MoE checkpoints).
EXPERT_MATRICES = {"w1": "w1", "w3": "w3", "w2": "w2",
                   "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def map_expert_weight(name: str, block: str) -> tuple[str, tuple[int, str]] | None:
    """A checkpoint tensor `{layer}.{block}.experts.{e}.{matrix}.weight` (or `.qweight`: a GGUF
    file's raw blocks) → (our stacked parameter `{layer}.mlp.experts.w13 | w2`, (e, w1 | w3 |
    w2)); None for any other name."""
    m = re.match(rf"(.*)\.{re.escape(block)}\.experts\.(\d+)\.(\w+)\.q?weight$", name)
    if m is None or m[3] not in EXPERT_MATRICES:
        return None
    shard = EXPERT_MATRICES[m[3]]
    return f"{m[1]}.mlp.experts.{'w2' if shard == 'w2' else 'w13'}", (int(m[2]), shard)
