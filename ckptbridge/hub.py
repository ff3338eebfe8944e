"""Hugging Face Hub ids wherever a model or adapter directory is accepted.

``ORG/NAME`` (optionally ``ORG/NAME@REVISION``) that is not a local path is resolved with
huggingface_hub's ``snapshot_download``: its cache (``HF_HOME`` / ``HF_HUB_CACHE``), its offline
mode (``HF_HUB_OFFLINE=1``: the cache only), its token. Only the files a verb needs are fetched,
and never pickle weights: a model's safetensors, configs and tokenizer files; for a base whose
weights are not read (LoRA conversions), its config and safetensors index; an adapter's config
and weights. The snapshot folder is returned; it lies in the cache, so model cards find the id
again from the path (:func:`ckptbridge.model_card.hub_id`).
"""

from __future__ import annotations

import os
import re

from ckptbridge import deps
from ckptbridge.errors import InputNotFoundError

# what each kind of input needs from a repository
MODEL = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.jinja", "*.txt", "*.tiktoken")
CONFIG = ("config.json", "*.safetensors.index.json")
ADAPTER = ("adapter_config.json", "adapter_model.safetensors", "base_quant.json")  # the last: a QLoRA adapter's record
IGNORE = ("original/*", "*/original/*", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx")

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def parse_id(ref: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``ref`` reads as a Hub model id (``ORG/NAME[@REV]``) and is
    not a local path; else None."""
    if os.path.exists(ref) or ref.startswith(("/", ".", "~", "gs://")):
        return None
    m = _ID.match(ref)
    if m is None or ".." in m.group("repo") or m.group("repo").endswith((".", "-")):
        return None
    return m.group("repo"), m.group("revision")


def local(ref: str, patterns: tuple[str, ...] = MODEL, *, revision: str | None = None,
          what: str = "model") -> str:
    """The local directory of ``ref``: ``ref`` itself when it is not a Hub id, else the cache
    snapshot of the repository with the files matching ``patterns`` (downloaded when missing and
    allowed). ``revision`` applies when the id names none."""
    parsed = parse_id(ref)
    if parsed is None:
        return ref
    repo, rev = parsed
    rev = rev or revision
    try:
        huggingface_hub = deps.load("huggingface_hub", "hub")
        errors = deps.load("huggingface_hub.errors", "hub")
    except deps.DependencyError as e:
        raise deps.DependencyError(f"{ref}: a Hub id; {e} (or pass a local directory)") from None
    where = f"{repo}@{rev}" if rev else repo
    # huggingface_hub 1.22 tells an incomplete cached snapshot apart; before, it is a missing entry
    incomplete = getattr(errors, "IncompleteSnapshotError", errors.LocalEntryNotFoundError)
    try:
        return huggingface_hub.snapshot_download(repo, revision=rev, allow_patterns=list(patterns),
                                                 ignore_patterns=list(IGNORE), library_name="ckptbridge")
    except errors.GatedRepoError:
        raise InputNotFoundError(f"{where}: a gated {what}; accept its terms on the Hub and log in "
                                 "(`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise InputNotFoundError(f"{where}: no such {what} on the Hub (or it is private: log in with "
                                 "`hf auth login` or HF_TOKEN); a local directory of that name does not exist either") \
            from None
    except errors.RevisionNotFoundError:
        raise InputNotFoundError(f"{where}: the Hub {what} {repo} has no revision {rev!r}") from None
    except (errors.LocalEntryNotFoundError, incomplete) as e:
        offline = "HF_HUB_OFFLINE=1 keeps it offline" if huggingface_hub.constants.HF_HUB_OFFLINE else \
            "the Hub cannot be reached"
        raise InputNotFoundError(
            f"{where}: not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) and {offline} "
            f"(nor a local directory of that name): download it first (`hf download {repo}`) or pass a local directory"
            + (" (the cached snapshot is incomplete)"
               if incomplete is not errors.LocalEntryNotFoundError and isinstance(e, incomplete) else "")
        ) from None
    except errors.HfHubHTTPError as e:
        raise InputNotFoundError(f"{where}: the Hub answered {' '.join(str(e).split())[:200]}") from None
