"""Real Hugging Face checkpoints, exported, loaded and served: a Llama with llama3 rope scaling and a Qwen3
(q/k norm), each written by `transformers` with a byte-level BPE tokenizer trained here by `tokenizers`
and a chat template of the model family's shape.

Served greedy tokens equal transformers' `generate`; the chat prompts the server renders equal
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`, for system, multi-turn, tool and
list-of-parts messages; a template that raises is a 400; without a template the plain `role: content`
fallback is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from conftest import TEST_EXPORT_JOBS, exported  # noqa: E402
from pt2serve.export.options import ExportOptions  # noqa: E402
from pt2serve.runtime.engine import open_runner  # noqa: E402
from pt2serve.runtime.runner import RunnerConfig  # noqa: E402
from pt2serve.serve.app import create_app  # noqa: E402
from pt2serve.serve.completions import _prompt_ids  # noqa: E402
from pt2serve.serve.config import ServerConfig  # noqa: E402
from pt2serve.serve.schemas import parse_chat  # noqa: E402
from test_artifact import with_metadata  # noqa: E402
from test_hf_parity import LLAMA3_SCALING, SMALL, randomize  # noqa: E402

MAX_CONTEXT = 128
# The tokenizers' size, specials included: below what BPE can merge out of CORPUS for either family (about
# 280), so both families reach it and their exports share one vocabulary's compiled samplers
# (tests/shared_samplers.py).
VOCAB_SIZE = 276
NUM_NEW = 12
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "What is the weather like today? It is sunny, with 21 degrees.",
    "Tools return results: {\"temperature\": 42, \"unit\": \"celsius\"}",
    "Hello world! Hello there, friend. How are you doing?",
    "Models read tokens; servers stream text back to the client.",
]

LLAMA_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a system or user message') }}{% endif %}"
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# The shape of Qwen3's own template (tools and reasoning left out): a system turn only first, tool results
# gathered into one user turn, and the thinking block on assistant turns after the last user query.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- if loop.index0 > ns.last_query_index and loop.last %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


@dataclass(frozen=True)
class Family:
    config_name: str
    extra: dict
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    template: str


FAMILIES = {
    "llama3": Family("LlamaConfig", {"rope_scaling": LLAMA3_SCALING},
                     ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
                     "<|begin_of_text|>", "<|eot_id|>", LLAMA_TEMPLATE),
    "qwen3": Family("Qwen3Config", {"head_dim": 16, "use_sliding_window": False, "tie_word_embeddings": True},
                    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", QWEN3_TEMPLATE),
}


def byte_level(byte: int) -> str:
    """The character the byte-level pre-tokenizer writes for `byte` (GPT-2's bytes-to-unicode table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def train_tokenizer(family: Family) -> Tokenizer:
    """Byte-level BPE over ASCII only: every token decodes to plain text, so streamed text is exact."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = [byte_level(b) for b in (9, 10, *range(32, 127))]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(family.specials),
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(list(family.specials))  # matched whole in text, skipped when decoding
    if family.bos is not None:  # as Llama 3's tokenizer.json: text is encoded with bos first
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", special_tokens=[(family.bos, tokenizer.token_to_id(family.bos))])
    return tokenizer


@dataclass
class Served:
    model: torch.nn.Module  # the transformers model, the reference
    tokenizer: object  # its transformers tokenizer
    artifact: Path
    client: TestClient


def write_checkpoint(folder: Path, family: Family, seed: int):
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(family), bos_token=family.bos, eos_token=family.eos,
        chat_template=family.template)
    tokenizer.save_pretrained(folder)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = getattr(transformers, family.config_name)(**{**SMALL, "vocab_size": len(tokenizer), **family.extra,
                                                           **ids})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory) -> Served:
    name = request.param
    folder = tmp_path_factory.mktemp(f"hf-{name}")
    model, tokenizer = write_checkpoint(folder, FAMILIES[name], seed=3)

    def options(path: Path) -> ExportOptions:
        return ExportOptions(backend="cpu", output=path, checkpoint=folder, dtype="fp32", forward_sizes=(1,),
                             max_context=MAX_CONTEXT, max_step_tokens=32, max_cells=1024,
                             jobs=TEST_EXPORT_JOBS)

    artifact = exported(f"hf-{name}", options, tmp_path_factory)
    runner = open_runner(artifact, runner_config=RunnerConfig(token_budget=32))
    with TestClient(create_app(ServerConfig(model_name=name), runner, owns_runner=True)) as client:
        yield Served(model, tokenizer, artifact, client)


@torch.no_grad()
def hf_generate(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    """transformers' greedy generate; it stops after the checkpoint's eos, as the server does."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def hf_chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def complete(client: TestClient, prompt, **body) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0,
                                                    **body})
    assert response.status_code == 200, response.text
    return response.json()


# -- generation ---------------------------------------------------------------------------------------------


def test_greedy_tokens_equal_transformers_generate(served):
    generator = torch.Generator().manual_seed(11)
    vocab = len(served.tokenizer)
    # Lengths beyond original_max_position_embeddings (64) use the llama3-scaled low frequencies, and a
    # prompt longer than max_step_tokens (32) is prefilled in chunks.
    for length in (1, 9, 40, 70, 110):
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        body = complete(served.client, prompt)
        assert body["choices"][0]["token_ids"] == hf_generate(served.model, prompt), length


def test_text_prompt_is_tokenized_as_transformers_does(served):
    text = "Hello there, friend. What is the weather like?"
    ids = served.tokenizer(text)["input_ids"]
    body = complete(served.client, text)
    assert body["usage"]["prompt_tokens"] == len(ids)
    expected = hf_generate(served.model, ids)
    assert body["choices"][0]["text"] == served.tokenizer.decode(expected, skip_special_tokens=True)


# -- chat templates -----------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello world!"}],
    "system": [SYSTEM, {"role": "user", "content": "What is the weather like today?"}],
    "multi-turn": [SYSTEM, {"role": "user", "content": "Hello there."},
                   {"role": "assistant", "content": "Hello, friend. How are you?"},
                   {"role": "user", "content": "  Sunny, with 21 degrees.\n"}],
    "tool": [{"role": "user", "content": "What is the temperature?"},
             {"role": "assistant", "content": "I will ask the tool.", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "temperature", "arguments": "{}"}},
                 {"id": "call_2", "type": "function", "function": {"name": "unit", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 42}"},
             {"role": "tool", "tool_call_id": "call_2", "content": "{\"unit\": \"celsius\"}"}],
    "parts": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                   {"type": "text", "text": "world!"}]}],
}


def as_text(messages: list[dict]) -> list[dict]:
    """The same messages with list-of-parts content joined, as the OpenAI API defines it."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
            for m in messages]


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_chat_prompt_equals_apply_chat_template(served, conversation):
    messages = CONVERSATIONS[conversation]
    runner = served.client.app.state.pt2serve.runner
    (rendered,) = _prompt_ids(runner, parse_chat({"messages": messages}))  # what the endpoint submits
    assert rendered == hf_chat_ids(served.tokenizer, as_text(messages))


@pytest.mark.parametrize("conversation", ["system", "parts"])
def test_served_chat_generates_from_the_rendered_prompt(served, conversation):
    messages = CONVERSATIONS[conversation]
    ids = hf_chat_ids(served.tokenizer, as_text(messages))
    response = served.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": NUM_NEW,
                                                                "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    expected = hf_generate(served.model, ids)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["message"]["content"] == served.tokenizer.decode(expected, skip_special_tokens=True)


def test_a_template_that_raises_is_a_400(served):
    if served.tokenizer.chat_template != LLAMA_TEMPLATE:
        pytest.skip("only the Llama template refuses a conversation")
    messages = [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Hello"}]
    with pytest.raises(Exception, match="must start with a system or user message"):
        served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    response = served.client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "must start with a system or user message" in error["message"]
    assert "Traceback" not in response.text


def test_a_template_that_writes_no_bos_gets_none(served, tmp_path):
    """A checkpoint template decides every special token, bos included: one that writes none (ChatML on a
    tokenizer that has a bos) gets none, as apply_chat_template gives it."""
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    path = tmp_path / "chatml.pt2"
    with_metadata(served.artifact, path, lambda m: m["tokenizer"].update(chat_template=chatml))
    runner = open_runner(path, runner_config=RunnerConfig(token_budget=32))
    try:
        messages = CONVERSATIONS["system"]
        expected = hf_chat_ids(served.tokenizer, messages, chat_template=chatml)
        assert _prompt_ids(runner, parse_chat({"messages": messages})) == [expected]
    finally:
        runner.close()


def test_without_a_template_chat_uses_plain_role_lines(served, tmp_path):
    """An artifact whose checkpoint had no chat template renders 'role: content' lines and an
    'assistant:' prompt, encoded as plain text is (with bos where the tokenizer has one)."""
    plain = tmp_path / "plain.pt2"
    with_metadata(served.artifact, plain, lambda m: m["tokenizer"].update(chat_template=None))
    runner = open_runner(plain, runner_config=RunnerConfig(token_budget=32))
    try:
        messages = [SYSTEM, {"role": "user", "content": "Hello world!"}]
        expected = served.tokenizer(f"system: {SYSTEM['content']}\nuser: Hello world!\nassistant:")["input_ids"]
        assert _prompt_ids(runner, parse_chat({"messages": messages})) == [expected]
        with TestClient(create_app(ServerConfig(model_name="plain"), runner)) as client:
            response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                  "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        runner.close()
