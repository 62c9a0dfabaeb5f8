"""Models by Hugging Face Hub id, from a Hub cache laid out by hand (HF_HUB_OFFLINE=1, a fresh
HF_HOME): the tiny Llama by id and by revision, served under its id; a GGUF repository by type
and by file name; a missing id, revision or type failing at once with a message naming it."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.model_loader.hub import HubModel, _wanted, parse_hub_id

MAIN, DEV = "a" * 40, "b" * 40


def _lay_out(hub: Path, repo: str, commits: dict[str, tuple[str, dict[str, Path]]]) -> None:
    """models--ORG--NAME/{refs/<ref>, snapshots/<sha>/<files>} as huggingface_hub writes it
    (files as symlinks into blobs/, as on a real machine)."""
    root = hub / ("models--" + repo.replace("/", "--"))
    for sha, (ref, files) in commits.items():
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(sha)
        snap = root / "snapshots" / sha
        snap.mkdir(parents=True)
        for name, src in files.items():
            blob = root / "blobs" / f"{sha}-{name}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copy(src, blob)
            os.symlink(os.path.relpath(blob, snap), snap / name)


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, tiny_model, smollm2_path):
    """A fresh HF_HOME: org/tiny-llama (main; dev: 64 max positions), org/smol-GGUF (the
    SmolLM2 Q4_1 file) and org/weights-bin (PyTorch .bin weights only)."""
    home = tmp_path_factory.mktemp("hf_home")
    hub = home / "hub"
    folder = Path(tiny_model("llama")[0])
    files = {f.name: f for f in folder.iterdir() if f.is_file()}
    short = home / "config-64.json"
    config = json.loads((folder / "config.json").read_text())
    short.write_text(json.dumps(config | {"max_position_embeddings": 64}))
    _lay_out(hub, "org/tiny-llama", {MAIN: ("main", files),
                                     DEV: ("dev", files | {"config.json": short})})
    _lay_out(hub, "org/smol-GGUF", {MAIN: ("main", {
        "smol-Q4_1.gguf": Path(smollm2_path), "README.md": folder / "config.json"})})
    _lay_out(hub, "org/weights-bin", {MAIN: ("main", {
        "config.json": folder / "config.json", "pytorch_model.bin": folder / "config.json"})})
    return home


@pytest.fixture
def offline_hub(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_home


def test_ids_are_told_from_paths(tmp_path, monkeypatch):
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == HubModel("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_hub_id("gpt2") == HubModel("gpt2")
    assert parse_hub_id("org/x-GGUF:Q4_K_M") == HubModel("org/x-GGUF", quant="Q4_K_M")
    assert parse_hub_id("org/x-GGUF/x.Q8_0.gguf") == HubModel("org/x-GGUF", file="x.Q8_0.gguf")
    for local in ("./models/x", "/abs/x", "~/x", "a/b/c/d", "model.Q4_1.gguf"):
        assert parse_hub_id(local) is None
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)  # an existing relative folder is a path, not an id
    (tmp_path / "org" / "name").mkdir()
    assert parse_hub_id("org/name") is None


def test_only_the_files_a_start_reads_are_fetched():
    """What a download asks for, from a real repository's listing (meta-llama/Llama-3.2-1B-
    Instruct: original/ holds the Meta checkpoint; a GGUF repository holds every type)."""
    llama = ["config.json", "generation_config.json", "model.safetensors", "LICENSE.txt",
             "README.md", "USE_POLICY.md", "special_tokens_map.json", "tokenizer.json",
             "tokenizer_config.json", "original/consolidated.00.pth", "original/params.json",
             "original/tokenizer.model", ".gitattributes"]
    assert _wanted(HubModel("m/l"), llama, False, "'m/l'") == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert _wanted(HubModel("m/l"), llama, True, "'m/l'") == [
        "config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    sharded = ["config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model-00001-of-00002.bin", "merges.txt", "vocab.json"]
    assert _wanted(HubModel("q/w"), sharded, False, "'q/w'") == [
        "config.json", "merges.txt", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "vocab.json"]
    # --trust-remote-code: the repository's own code too (top level), never otherwise
    coded = [*sharded, "configuration_w.py", "tokenization_w.py", "sub/helper.py"]
    assert _wanted(HubModel("q/w"), coded, False, "'q/w'", with_code=True) == sorted([
        *_wanted(HubModel("q/w"), sharded, False, "'q/w'"), "configuration_w.py",
        "tokenization_w.py"])
    assert _wanted(HubModel("q/w"), coded, False, "'q/w'") == _wanted(
        HubModel("q/w"), sharded, False, "'q/w'")
    gguf = ["README.md", "x-Q4_K_M.gguf", "x-Q4_K_S.gguf", "x-Q4_K.gguf", "x-Q8_0.gguf",
            "big/x-Q4_K_M-00001-of-00002.gguf"]
    assert _wanted(HubModel("o/x", quant="Q4_K"), gguf, False, "") == ["x-Q4_K.gguf"]
    assert _wanted(HubModel("o/x", quant="q4_k_m"), gguf, False, "") == ["x-Q4_K_M.gguf"]
    with pytest.raises(ValueError, match="several GGUF files of its model"):
        _wanted(HubModel("o/x"), gguf, False, "")
    with pytest.raises(ValueError, match="split into several files"):
        _wanted(HubModel("o/x", quant="Q4_K_M"), gguf[-1:], False, "")


def test_a_model_by_id_and_by_revision_served_under_its_id(offline_hub, tiny_model):
    folder, _ = tiny_model("llama")
    prompt = [[1, 5, 900, 31, 4000, 77]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = LLM(folder, num_kv_blocks=64).generate(prompt, params, use_tqdm=False)
    llm = LLM("org/tiny-llama", num_kv_blocks=64)
    model = llm.engine.config.model
    assert model.served_name == "org/tiny-llama" and model.hub_id == "org/tiny-llama"
    assert model.path.endswith(f"snapshots/{MAIN}") and model.max_model_len == 512
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    for revision in ("dev", DEV):
        dev = engine_config("org/tiny-llama", revision=revision).model
        assert dev.path.endswith(f"snapshots/{DEV}") and dev.max_model_len == 64


def test_a_gguf_repository_by_type_and_by_file(offline_hub, smollm2_path):
    for name in ("org/smol-GGUF:Q4_1", "org/smol-GGUF:q4_1", "org/smol-GGUF/smol-Q4_1.gguf",
                 "org/smol-GGUF"):  # its only GGUF file
        model = engine_config(name).model
        assert model.gguf_file is not None and model.gguf_file.endswith("smol-Q4_1.gguf")
        assert filecmp.cmp(model.gguf_file, smollm2_path, shallow=False)
        assert model.served_name == name
    with pytest.raises(ValueError, match=r"'org/smol-GGUF:Q4_K_M' has no GGUF file of type "
                                         r"Q4_K_M; its GGUF files: smol-Q4_1.gguf"):
        engine_config("org/smol-GGUF:Q4_K_M")
    with pytest.raises(ValueError, match="has no file 'other.gguf'"):
        engine_config("org/smol-GGUF/other.gguf")


def test_a_tokenizer_from_another_id(offline_hub, smollm2_path):
    llm = LLM(smollm2_path, tokenizer="org/tiny-llama", num_kv_blocks=16)
    assert llm.engine.config.model.tokenizer.endswith(f"snapshots/{MAIN}")
    assert llm.get_tokenizer().encode("Paris") == llm.get_tokenizer().encode("Paris")
    assert llm.get_tokenizer().name_or_path.endswith(f"snapshots/{MAIN}")


@pytest.mark.parametrize("name,kwargs,message", [
    ("org/missing", {}, r"model 'org/missing' is not in the local Hugging Face cache and "
                        r"HF_HUB_OFFLINE=1"),
    ("org/tiny-llama", {"revision": "v9"}, r"model 'org/tiny-llama' at revision 'v9' is not "
                                           r"in the local Hugging Face cache"),
    ("org/weights-bin", {}, r"has no \*.safetensors weights \(only .bin, which tokenmill does "
                            r"not read\)"),
])
def test_what_cannot_be_resolved_fails_at_once_naming_it(offline_hub, name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_config(name, **kwargs)


def test_an_unreachable_hub_fails_at_once_naming_the_id(tmp_path, monkeypatch):
    """Online, an id not in the cache and a Hub that cannot be reached (here: a refused
    connection, as with no network): the id and the reason, not the HTTP client's traceback."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"model 'org/missing' is not in the local Hugging "
                                         r"Face cache and the Hub could not be reached"):
        engine_config("org/missing")


def test_serve_an_unknown_id_exits_with_the_message_not_a_traceback(offline_hub):
    env = os.environ | {"HF_HOME": str(offline_hub), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "org/missing", "--port",
                        "0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "org/missing" in r.stderr and "Traceback" not in r.stderr


def test_the_token_goes_with_every_hub_request(monkeypatch, tiny_model, tmp_path):
    """--hf-token reaches huggingface_hub's file list and download (its client stands in: no
    network here); the cache is looked at first, without it."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    folder = tiny_model("llama")[0]
    seen = []

    class Api:
        def __init__(self, token=None):
            seen.append(("list", token))

        def list_repo_files(self, repo, revision=None):
            return sorted(os.listdir(folder))

    def download(repo, revision=None, cache_dir=None, local_files_only=False,
                 allow_patterns=None, token=None):
        if local_files_only:
            raise LocalEntryNotFoundError("an empty cache")
        seen.append(("download", token))
        return folder

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    config = engine_config("org/private-llama", hf_token="hf_secret")
    assert config.model.hub_id == "org/private-llama" and config.model.path == folder
    assert seen == [("list", "hf_secret"), ("download", "hf_secret")]
