"""Checkpoints named by a Hub id, resolved through huggingface_hub against a local cache laid out as the Hub
lays it out (refs/, snapshots/<commit>/ linking into blobs/), offline: nothing is fetched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.model import hub

transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

REPO = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding REPO at COMMIT (main), and the plain folder it was saved from."""
    root = tmp_path_factory.mktemp("hub")
    saved = root / "saved"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).save_pretrained(saved)
    (saved / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    repo = root / "cache" / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir()
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return root


def offline(hub_cache, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (huggingface_hub reads its settings at import) on the test cache."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache / "cache"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_cache):
    code = f"""
import torch
from pt2serve.errors import Pt2ServeError
from pt2serve.model.checkpoint import load_model
from pt2serve.model.hub import resolve_checkpoint
for revision in (None, "main", "{COMMIT}"):
    resolved = resolve_checkpoint("{REPO}", revision)
    print(resolved.path, resolved.source)
via_hub = load_model(str(resolved.path), None, torch.float32)
local = load_model("{hub_cache / 'saved'}", None, torch.float32)
assert all(torch.equal(a, b) for a, b in zip(via_hub.model.parameters(), local.model.parameters()))
print(via_hub.generation_defaults)
for repo, revision in (("{REPO}", "v2"), ("acme/absent", None)):
    try:
        resolve_checkpoint(repo, revision)
    except Pt2ServeError as err:
        print("refused:", err)
"""
    result = offline(hub_cache, code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    snapshot = hub_cache / "cache" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert lines[:3] == [f"{snapshot} hub:{REPO}@{COMMIT}"] * 3
    assert lines[3] == "{'temperature': 0.6, 'top_p': 0.9}"
    assert lines[4].startswith(f"refused: {REPO}@v2 is not in the Hugging Face cache")
    assert lines[5].startswith("refused: acme/absent is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in lines[5]


def test_export_cli_says_why_an_uncached_id_cannot_be_read_offline(hub_cache, tmp_path):
    code = ("import sys; from pt2serve.cli import app; sys.argv = ['pt2serve', 'export', '--backend', 'cpu', "
            f"'--use-offgraph-kv-cache', '--checkpoint', 'acme/absent', '-o', '{tmp_path / 'x.pt2'}']; app()")
    result = offline(hub_cache, code)
    assert result.returncode != 0
    assert "acme/absent is not in the Hugging Face cache" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x.pt2").exists()


def test_only_the_files_an_export_reads_are_fetched(tmp_path, monkeypatch):
    """Online, the first fetch takes the small files; the second exactly the shards the index names."""
    import huggingface_hub

    folder = tmp_path / COMMIT
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "c": "model-00001-of-00002.safetensors"}}))
    calls = []

    def fake_snapshot_download(repo_id, revision=None, token=None, allow_patterns=None):
        calls.append((repo_id, revision, token, allow_patterns))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    resolved = hub.resolve_checkpoint("org/model", "v1", "secret")
    assert resolved.path == folder and resolved.source == f"hub:org/model@{COMMIT}"
    first, second = calls
    assert first[:3] == ("org/model", "v1", "secret") and "*.safetensors" not in first[3]
    assert "config.json" in first[3] and "model.safetensors.index.json" in first[3]
    assert second == ("org/model", COMMIT, "secret",
                      ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    (folder / "model.safetensors.index.json").unlink()
    calls.clear()
    hub.resolve_checkpoint("org/model")
    assert calls[1][3] == ["model.safetensors"]


def test_local_folders_are_not_hub_ids(tmp_path):
    assert hub.resolve_checkpoint(str(tmp_path)).path == tmp_path
    with pytest.raises(Pt2ServeError, match="--revision applies to a Hugging Face Hub id"):
        hub.resolve_checkpoint(str(tmp_path), revision="main")
    assert hub.resolve_checkpoint("./no/such/folder").source == "checkpoint:./no/such/folder"  # not an id
    assert hub.is_hub_id("meta-llama/Llama-3.1-8B-Instruct") and not hub.is_hub_id("a/b/c")
