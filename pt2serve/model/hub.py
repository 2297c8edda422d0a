"""Checkpoints named by a Hugging Face Hub id (ORG/NAME), resolved to a local folder through huggingface_hub.

huggingface_hub does what users expect of every peer: its cache (HF_HUB_CACHE / HF_HOME), a revision (a
branch, tag or commit), a token (--hf-token, HF_TOKEN or a saved login) and HF_HUB_OFFLINE=1 (the cache
only). Only the files an export reads are fetched; a sharded checkpoint fetches every shard its index
names, and nothing else (no .bin or .pth duplicates, no original/ folder).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pt2serve.errors import Pt2ServeError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What load_checkpoint reads besides the weights: config, tokenizer, template, generation defaults, shard index.
SMALL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "model.safetensors.index.json"]


@dataclass(frozen=True)
class ResolvedCheckpoint:
    path: Path  # a local folder with the checkpoint's files
    source: str  # what the artifact records: the folder, or the Hub id at the commit it was fetched at


def is_hub_id(text: str) -> bool:
    return HUB_ID.fullmatch(text) is not None


def resolve_checkpoint(checkpoint: str, revision: str | None = None, token: str | None = None) -> ResolvedCheckpoint:
    """A local folder as it is; an ORG/NAME that is no local folder through the Hub's cache (fetching what is
    missing unless offline). Raises Pt2ServeError with what to do when it cannot."""
    local = Path(checkpoint)
    if local.exists() or not is_hub_id(checkpoint):
        if revision is not None:
            raise Pt2ServeError("--revision applies to a Hugging Face Hub id (ORG/NAME), not a local folder")
        return ResolvedCheckpoint(local, f"checkpoint:{checkpoint}")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise Pt2ServeError(f"{checkpoint!r} is no local folder, and reading it from the Hugging Face Hub needs "
                            "huggingface_hub: pip install huggingface_hub") from None
    try:
        folder = Path(huggingface_hub.snapshot_download(checkpoint, revision=revision, token=token,
                                                        allow_patterns=SMALL_FILES))
        if not (folder / "config.json").is_file():
            raise Pt2ServeError(f"the Hugging Face Hub repository {checkpoint} has no config.json: it is not a "
                                "transformers checkpoint")
        # The weights the index names (or the one file): repositories often hold other copies beside them.
        commit = folder.name  # a snapshot folder is named by its commit: both fetches see the same files
        huggingface_hub.snapshot_download(checkpoint, revision=commit, token=token,
                                          allow_patterns=_weight_files(folder))
    except errors.RevisionNotFoundError:
        raise Pt2ServeError(f"the Hugging Face Hub repository {checkpoint} has no revision {revision!r}") from None
    except errors.GatedRepoError:
        raise Pt2ServeError(f"{checkpoint} is gated: accept its license on the Hub, then pass --hf-token or set "
                            "HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise Pt2ServeError(f"{checkpoint!r} is no local folder and no Hugging Face Hub repository this token can "
                            "see (private repositories need --hf-token or HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError:
        raise Pt2ServeError(
            f"{checkpoint}{'@' + revision if revision else ''} is not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) and cannot be fetched: the Hub is unreachable or "
            "HF_HUB_OFFLINE is set. Fetch it once online, or pass a local folder") from None
    except (errors.HfHubHTTPError, OSError) as err:
        raise Pt2ServeError(f"fetching {checkpoint} from the Hugging Face Hub failed: {err}") from None
    return ResolvedCheckpoint(folder, f"hub:{checkpoint}@{commit}")


def _weight_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as err:
        raise Pt2ServeError(f"{index} is not a safetensors index ({err})") from None
