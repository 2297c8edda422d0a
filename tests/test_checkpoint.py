"""load_checkpoint: sharded and bf16 loads, tokenizer files, and a clear error for each malformed directory."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from pt2serve.errors import Pt2ServeError  # noqa: E402
from pt2serve.model.checkpoint import load_checkpoint, load_model  # noqa: E402
from pt2serve.model.eager import EagerSequence  # noqa: E402
from pt2serve.tokenizer import Tokenizer  # noqa: E402

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=256,
)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 1]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One unsharded and one sharded save of the same weights (building models dominates the test time)."""
    root = tmp_path_factory.mktemp("ckpt")
    config = transformers.LlamaConfig(**SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():  # spread the logits; the default init makes them nearly flat
            param.normal_(0.0, 0.1)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


def copy_dir(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def logits(model):
    return EagerSequence(model, len(PROMPT)).extend(PROMPT)


def edit_json(path, **fields):
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def edit_weights(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# --- loads -----------------------------------------------------------------------------------------------------


def test_sharded_matches_unsharded(saved):
    sharded = saved / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single = load_checkpoint(saved / "single", torch.float32)
    split = load_checkpoint(sharded, torch.float32)
    assert split.config == single.config
    assert torch.equal(logits(split.model), logits(single.model))
    assert split.source == str(sharded)
    assert not split.model.training


def test_bf16_load(saved):
    fp32 = load_checkpoint(saved / "single", torch.float32)
    bf16 = load_checkpoint(saved / "single", torch.bfloat16)
    assert all(param.dtype == torch.bfloat16 for param in bf16.model.parameters())
    # The rotary frequencies stay fp32: rounding them to bf16 would shift every angle.
    assert bf16.model.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.model.inv_freq, fp32.model.inv_freq)
    for name, param in bf16.model.named_parameters():
        assert torch.equal(param, dict(fp32.model.named_parameters())[name].to(torch.bfloat16)), name
    expected, got = logits(fp32.model), logits(bf16.model)
    assert (got - expected).abs().max() / expected.abs().max() < 0.05


def test_tied_checkpoint_ignores_stored_head_and_rotary_buffers(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "tied")
    edit_json(ckpt / "config.json", tie_word_embeddings=True)

    def add_extras(tensors):
        tensors["lm_head.weight"] = torch.randn(300, 64)  # some tied checkpoints store the head anyway
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)

    edit_weights(ckpt / "model.safetensors", add_extras)
    loaded = load_checkpoint(ckpt, torch.float32)
    assert loaded.model.lm_head is None
    assert torch.equal(loaded.model.embed_tokens.weight, load_file(ckpt / "model.safetensors")["model.embed_tokens.weight"])


# --- tokenizer -------------------------------------------------------------------------------------------------

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|eot|>": 5}


def write_tokenizer(path, tokenizer_config=None, generation_config=None):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = HFTokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<|eot|>"])  # so "<s>" in template text stays one token
    tokenizer.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))


def test_tokenizer_files(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "tok")
    write_tokenizer(
        ckpt,
        tokenizer_config={
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True},
            "chat_template": CHAT_TEMPLATE,
        },
        generation_config={"bos_token_id": 1, "eos_token_id": [2, 5]},
    )
    files = load_checkpoint(ckpt, torch.float32).tokenizer
    assert files is not None
    assert files.tokenizer_json == (ckpt / "tokenizer.json").read_text()
    assert files.bos_token_id == 1
    assert files.eos_token_ids == (2, 5)  # tokenizer_config's eos united with generation_config's
    assert files.chat_template == CHAT_TEMPLATE
    assert files.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    tokenizer = Tokenizer(files)
    assert tokenizer.encode("hello world") == [1, 3, 4]
    assert tokenizer.encode_chat([{"role": "user", "content": "hello"}]) == [1, 3]


def test_tokenizer_named_templates_and_jinja_file(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "tok")
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    write_tokenizer(ckpt, tokenizer_config={"eos_token": "<|eot|>", "chat_template": named}, generation_config={"eos_token_id": 2})
    files = load_checkpoint(ckpt, torch.float32).tokenizer
    assert files.chat_template == "DEFAULT"
    assert files.bos_token_id is None
    assert files.eos_token_ids == (5, 2)
    assert files.special_tokens == {"eos_token": "<|eot|>"}

    # A chat_template.jinja file (how newer transformers save it) wins, as it does in transformers.
    (ckpt / "chat_template.jinja").write_text("FROM FILE")
    assert load_checkpoint(ckpt, torch.float32).tokenizer.chat_template == "FROM FILE"


def test_no_tokenizer_json(saved):
    assert load_checkpoint(saved / "single", torch.float32).tokenizer is None


# --- malformed checkpoints -------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(Pt2ServeError, match="nope.*does not exist"):
        load_checkpoint(tmp_path / "nope", torch.float32)


def test_missing_config(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    (ckpt / "config.json").unlink()
    with pytest.raises(Pt2ServeError, match="config.json is missing"):
        load_checkpoint(ckpt, torch.float32)


def test_config_not_json(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(Pt2ServeError, match="config.json is not valid JSON"):
        load_checkpoint(ckpt, torch.float32)


def test_missing_weights(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(Pt2ServeError, match="no model.safetensors and no model.safetensors.index.json"):
        load_checkpoint(ckpt, torch.float32)


def test_missing_shard(saved, tmp_path):
    ckpt = copy_dir(saved / "sharded", tmp_path / "c")
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(Pt2ServeError, match=f"index.json names shard '{shard.name}'.*missing"):
        load_checkpoint(ckpt, torch.float32)


def test_missing_tensor(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    edit_weights(ckpt / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(Pt2ServeError, match=r"'model.layers.1.mlp.up_proj.weight' needed by the model is missing"):
        load_checkpoint(ckpt, torch.float32)


def test_missing_lm_head_when_untied(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    edit_weights(ckpt / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(Pt2ServeError, match="'lm_head.weight'.*tie_word_embeddings=false"):
        load_checkpoint(ckpt, torch.float32)


def test_wrong_shape(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")

    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_weights(ckpt / "model.safetensors", shrink)
    with pytest.raises(
        Pt2ServeError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\], expected \[32, 64\]"
    ):
        load_checkpoint(ckpt, torch.float32)


def test_unexpected_key(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")

    def add(tensors):
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    edit_weights(ckpt / "model.safetensors", add)
    with pytest.raises(Pt2ServeError, match="model.safetensors: unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_checkpoint(ckpt, torch.float32)


def test_unsupported_architecture(saved, tmp_path):
    ckpt = copy_dir(saved / "single", tmp_path / "c")
    edit_json(ckpt / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(Pt2ServeError, match="config.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(ckpt, torch.float32)


def test_mistral_sliding_window_refused(tmp_path):
    config = transformers.MistralConfig(**SMALL, sliding_window=4096)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(Pt2ServeError, match="config.json: sliding_window=4096"):
        load_checkpoint(tmp_path, torch.float32)


# --- load_model ------------------------------------------------------------------------------------------------


def test_load_model_needs_exactly_one_source(saved):
    with pytest.raises(Pt2ServeError, match="exactly one.*both"):
        load_model(str(saved / "single"), "tiny", torch.float32, "cpu")
    with pytest.raises(Pt2ServeError, match="exactly one.*neither"):
        load_model(None, None, torch.float32, "cpu")


def test_load_model_dispatches(saved):
    loaded = load_model(str(saved / "single"), None, torch.float32, "cpu")
    config, model, tokenizer = loaded.config, loaded.model, loaded.tokenizer
    assert loaded.quantization_method is None
    assert config.architecture == "LlamaForCausalLM" and tokenizer is None
    assert model.embed_tokens.weight.shape == (300, 64)
    loaded = load_model(None, "tiny-random", torch.float32, "cpu")
    config, tokenizer = loaded.config, loaded.tokenizer
    assert config.vocab_size == 258 and tokenizer is not None and tokenizer.bos_token_id == 256
