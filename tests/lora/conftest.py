"""peft adapters over the tiny Llama, made with random A and B (`init_lora_weights=False`: peft's
default leaves B at zero, an adapter that changes nothing and would prove nothing), saved as
users have them, with peft's own merged model as each one's reference."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy

# name → (rank, alpha, targets, rslora)
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False),
    "all4": (4, 8, "all-linear", True),
    "mlp16": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "ko2": (2, 4, ["k_proj", "o_proj"], False),
}


@dataclass
class Adapters:
    base_path: str
    base: torch.nn.Module
    paths: dict[str, str]
    merged: dict[str, torch.nn.Module]

    def reference(self, name: str | None, prompt: list[int], n: int) -> list[int]:
        return hf_greedy(self.base if name is None else self.merged[name], prompt, n)


def edited_copy(src: str, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict]) -> Path:
    """A copy of adapter folder `src` in `dst`, its tensors replaced by edit(tensors)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    save_file(edit(load_file(file)), file)
    return dst


def make_adapter(base: torch.nn.Module, out: Path, rank: int, alpha: int, targets, rslora: bool,
                 seed: int) -> torch.nn.Module:
    """Save a peft adapter of `base` into `out`; return peft's merged model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False))
    model.save_pretrained(out)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory) -> Adapters:
    pytest.importorskip("peft")  # (a test extra: the lent GPU machine may lack it)
    path, base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    paths, merged = {}, {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        merged[name] = make_adapter(base, root / name, rank, alpha, targets, rslora, seed + 1)
    return Adapters(path, base, paths, merged)
