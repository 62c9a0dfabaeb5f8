"""Models named by Hugging Face Hub id, resolved to local files through huggingface_hub.

The forms users bring from vLLM and llama.cpp:

    ORG/NAME             a safetensors repository (config.json, *.safetensors, the tokenizer
                         files and chat template), or a GGUF repository with one .gguf file
    ORG/NAME:QUANT       llama.cpp's `-hf` form: the repository's .gguf file of that type
                         (Q4_K_M, q8_0, ... matched in the file name, case-insensitive)
    ORG/NAME/FILE.gguf   that file of a GGUF repository (vLLM's form)

Invariants:
- the local cache is read first (`download_dir`, else HF_HUB_CACHE / HF_HOME as huggingface_hub
  reads them, at call time): a complete cached snapshot starts without any network request;
- only the files a start needs are downloaded (never other weight formats, never files in
  subfolders such as `original/`), with huggingface_hub's progress bars and per-file locks, so
  concurrent starts share one download;
- HF_HUB_OFFLINE=1 serves from the cache only; HF_TOKEN (or a stored login) is read by
  huggingface_hub itself, and `token` (vLLM's --hf-token: a token, or True for the stored
  login) is used instead where given;
- a name that cannot be resolved (offline and not cached, no such repository or revision, a
  gated one, no file of the asked type) is a ValueError naming it, never a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenmill.lora.peft_files import CONFIG_FILE as ADAPTER_CONFIG
from tokenmill.lora.peft_files import WEIGHT_FILES as ADAPTER_WEIGHTS

# what a safetensors start reads: config, weights (with their index), tokenizer, chat template
_CONFIG_FILES = ("config.json", "generation_config.json")
_TOKENIZER_SUFFIXES = (".json", ".model", ".tiktoken", ".txt", ".jinja")
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens",
                       "chat_template", "preprocessor_config")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_ID = re.compile(r"(?P<repo>(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*)"
                 r"(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))?")


@dataclass(frozen=True)
class HubModel:
    """A parsed model id: the repository and, for GGUF repositories, the file or type asked."""

    repo: str
    quant: str | None = None
    file: str | None = None


def parse_hub_id(name: str) -> HubModel | None:
    """The Hub id `name` spells, or None where it cannot be one (or is a local path)."""
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 2:
        return None
    if "/" not in name and name.lower().endswith(".gguf"):  # a file (ids name ORG/NAME/FILE)
        return None
    m = _ID.fullmatch(name)
    if m is None or (m.group("file") is None and name.count("/") > 1):
        return None
    return HubModel(m.group("repo"), m.group("quant"), m.group("file"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir(download_dir: str | None) -> str | None:
    """The hub cache to read and fill, from the environment as it is now (huggingface_hub
    reads it once, at import)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve_hub_model(name: str, revision: str | None = None,
                      download_dir: str | None = None, tokenizer_only: bool = False,
                      with_code: bool = False, token: str | bool | None = None) -> str:
    """The local path of the model (or, tokenizer_only, the tokenizer) that Hub id `name`
    names: a snapshot folder, or the .gguf file asked for; downloaded if not cached.
    with_code (--trust-remote-code): the repository's top-level .py files too."""
    spec = parse_hub_id(name)
    if spec is None:
        raise ValueError(f"model {name!r} is neither a local path nor a Hugging Face Hub id")
    with _hub_errors("model", name, revision) as where:
        return _resolve(spec, revision, _cache_dir(download_dir), where,
                        lambda files: _wanted(spec, files, tokenizer_only, where, with_code),
                        tokenizer_only, token)


def resolve_hub_adapter(name: str, revision: str | None = None,
                        download_dir: str | None = None,
                        token: str | bool | None = None) -> str:
    """The local snapshot folder of the peft adapter repository `name` (its
    adapter_config.json and weights only), downloaded if not cached (vLLM's lora_path)."""
    spec = parse_hub_id(name)
    if spec is None or spec.quant or spec.file:
        raise ValueError(f"LoRA adapter {name!r} is neither a local folder nor a Hugging Face "
                         "Hub id")

    def wanted(files: list[str]) -> list[str]:
        if ADAPTER_CONFIG not in files:
            raise ValueError(f"LoRA adapter {name!r} has no {ADAPTER_CONFIG}")
        weights = [f for f in ADAPTER_WEIGHTS if f in files][:1]
        if not weights:
            raise ValueError(f"LoRA adapter {name!r} has no {' or '.join(ADAPTER_WEIGHTS)}")
        return [ADAPTER_CONFIG, *weights]

    with _hub_errors("LoRA adapter", name, revision) as where:
        return _resolve(spec, revision, _cache_dir(download_dir), where, wanted, True, token)


@contextlib.contextmanager
def _hub_errors(what: str, name: str, revision: str | None) -> Iterator[str]:
    """huggingface_hub's failures as one-line ValueErrors naming the `what` (model, LoRA
    adapter) and the id; yields the id as the messages name it."""
    from huggingface_hub import errors

    where = f"{name!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        yield where
    except errors.GatedRepoError as e:
        raise ValueError(f"{what} {where} is gated: accept its terms on huggingface.co and set "
                         f"HF_TOKEN ({_first_line(e)})") from e
    except errors.RepositoryNotFoundError as e:
        raise ValueError(f"{what} {where}: no such Hugging Face repository (or it is private: "
                         "set HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise ValueError(f"{what} {name!r}: the repository has no revision {revision!r}") from e
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        state = "HF_HUB_OFFLINE=1" if offline() else "the Hub could not be reached"
        raise ValueError(f"{what} {where} is not in the local Hugging Face cache and {state} "
                         f"({_first_line(e)})") from e
    except (errors.HfHubHTTPError, OSError) as e:
        raise ValueError(f"{what} {where} could not be downloaded: {_first_line(e)}") from e
    except _transport_errors() as e:  # no network, DNS, refused, timed out
        raise ValueError(f"{what} {where} is not in the local Hugging Face cache and the Hub "
                         f"could not be reached ({_first_line(e)}); HF_HUB_OFFLINE=1 serves "
                         "from the cache alone") from e


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The connection errors of the HTTP client huggingface_hub uses (httpx's, named httpx2
    in some builds; requests' are OSErrors, caught above), none of which are OSErrors."""
    found = []
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _resolve(spec: HubModel, revision: str | None, cache: str | None, where: str,
             wanted_of: Callable[[list[str]], list[str]], folder_only: bool,
             token: str | bool | None = None) -> str:
    """The snapshot holding the files `wanted_of(repository files)` names: the cached one
    where it has them all, else downloaded (those files only). folder_only: the folder even
    when a .gguf file is wanted."""
    from huggingface_hub import HfApi, snapshot_download

    snapshot = _cached_snapshot(spec.repo, revision, cache)
    if snapshot is not None:  # the cache first: complete, it needs no network at all
        wanted = wanted_of(_files_in(snapshot))
        if all((snapshot / f).is_file() for f in wanted):
            return _result(snapshot, wanted, folder_only)
    if offline():
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("the needed files are not all cached")
    wanted = wanted_of(HfApi(token=token).list_repo_files(spec.repo, revision=revision))
    folder = snapshot_download(spec.repo, revision=revision, cache_dir=cache,
                               allow_patterns=wanted, token=token)
    return _result(Path(folder), wanted, folder_only)


def _cached_snapshot(repo: str, revision: str | None, cache: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _result(folder: Path, wanted: list[str], folder_only: bool) -> str:
    ggufs = [f for f in wanted if f.endswith(".gguf")]
    return str(folder / ggufs[0]) if ggufs and not folder_only else str(folder)


def _wanted(spec: HubModel, files: list[str], tokenizer_only: bool, where: str,
            with_code: bool = False) -> list[str]:
    """The repository files a start reads (see module doc), and its code with_code."""
    top = [f for f in files if "/" not in f]
    code = [f for f in top if f.endswith(".py")] if with_code else []
    tokenizer = [f for f in top if f.startswith(_TOKENIZER_PREFIXES)
                 and f.endswith(_TOKENIZER_SUFFIXES)]
    if tokenizer_only:
        if not tokenizer:
            raise ValueError(f"tokenizer {where} has no tokenizer files")
        return sorted({*tokenizer, *code, *(f for f in top if f == "config.json")})
    ggufs = [f for f in files if f.endswith(".gguf")]
    if spec.quant or spec.file or ("config.json" not in top and ggufs):
        return [_gguf_file(spec, ggufs, where)]
    if "config.json" not in top:
        raise ValueError(f"model {where} has no config.json or .gguf file to serve")
    weights = [f for f in top if f.endswith(".safetensors") or f == "model.safetensors.index.json"]
    if not any(f.endswith(".safetensors") for f in weights):
        kinds = sorted({os.path.splitext(f)[1] for f in top if f.endswith((".bin", ".pt", ".pth"))})
        raise ValueError(f"model {where} has no *.safetensors weights"
                         + (f" (only {', '.join(kinds)}, which tokenmill does not read)"
                            if kinds else ""))
    return sorted({*(f for f in top if f in _CONFIG_FILES), *weights, *tokenizer, *code})


def _gguf_file(spec: HubModel, ggufs: list[str], where: str) -> str:
    """The one .gguf file asked for (by name, by type, or the repository's only one)."""
    if spec.file is not None:
        if spec.file not in ggufs:
            raise ValueError(f"model {where} has no file {spec.file!r}; its GGUF files: "
                             f"{', '.join(ggufs) or 'none'}")
        return spec.file
    found = ggufs
    if spec.quant is not None:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(spec.quant)}(?![A-Za-z0-9_])", re.I)
        found = [f for f in ggufs if tag.search(os.path.basename(f)[:-len(".gguf")])]
    whole = [f for f in found if not _SPLIT_GGUF.search(f)]
    if not whole and found:
        raise ValueError(f"model {where}: {found[0]} is split into several files, which "
                         "tokenmill does not read yet; merge it with llama.cpp's gguf-split")
    if len(whole) == 1:
        return whole[0]
    what = f"type {spec.quant}" if spec.quant else "its model"
    listed = ", ".join(ggufs) or "none"
    if not whole:
        raise ValueError(f"model {where} has no GGUF file of {what}; its GGUF files: {listed}")
    raise ValueError(f"model {where} has several GGUF files of {what} ({', '.join(whole)}); "
                     "name one as ORG/NAME/FILE.gguf" + ("" if spec.quant else
                                                        " or a type as ORG/NAME:Q4_K_M"))
