"""lm-evaluation-harness against the server, as a user runs it: `local-completions` with batch_size 4, with
a Hugging Face tokenizer of the user's or, by default, the server's own (its /tokenize endpoints).

Its loglikelihoods (echo + logprobs over batched token-id prompts) must equal those computed from the
model directly, and its generations those of the runner. The tasks are two small local files written here
(one multiple-choice loglikelihood task, one generate_until task); nothing is fetched.
"""

from __future__ import annotations

import json

import pytest
import torch

from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model, byte_tokenizer_files
from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from servers import ServerThread

lm_eval = pytest.importorskip("lm_eval")

MODEL = "tiny"
QUESTIONS = [
    ("The sky is", [" blue", " green", " loud"], 0),
    ("Two plus two is", [" four", " five"], 0),
    ("Water is", [" wet", " dry", " red", " square"], 1),
    ("Cats say", [" meow", " woof"], 0),
    ("Snow is", [" cold", " hot", " warm"], 0),
]


def write_tasks(folder) -> None:
    data = folder / "data"
    data.mkdir(parents=True)
    with open(data / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for question, choices, _ in QUESTIONS:
            f.write(json.dumps({"question": question, "answer": choices[0]}) + "\n")
    common = "dataset_path: json\ntest_split: train\ndoc_to_text: \"{{question}}\"\n"
    (folder / "toy_mc.yaml").write_text(
        f"task: toy_mc\n{common}dataset_kwargs:\n  data_files: {data / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "toy_gen.yaml").write_text(
        f"task: toy_gen\n{common}dataset_kwargs:\n  data_files: {data / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def write_tokenizer(folder) -> None:
    """The tiny-random preset's tokenizer as a Hugging Face tokenizer folder, for lm-eval's own tokenization."""
    files = byte_tokenizer_files()
    folder.mkdir()
    (folder / "tokenizer.json").write_text(files.tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": files.special_tokens["bos_token"],
        "eos_token": files.special_tokens["eos_token"], "model_max_length": 256}))


@pytest.fixture(scope="module")
def served(tiny_artifact):
    from pt2serve.runtime.engine import open_runner

    runner = open_runner(tiny_artifact, device="cpu")
    app = create_app(ServerConfig(model_name=MODEL), runner)
    batches: list[int] = []  # prompts per completions request, as lm-eval sends them

    @app.middleware("http")
    async def count_prompts(request, call_next):
        if request.url.path == "/v1/completions":
            prompt = json.loads(await request.body()).get("prompt")
            batches.append(len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (list, str)) else 1)
        return await call_next(request)

    thread = ServerThread(app).start()
    yield thread.url, runner, batches
    thread.stop()
    runner.close()


def offline(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def evaluate(lm, tmp_path, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path / "tasks")
    # Only the tasks written here: indexing lm-eval's thousands of built-in task files takes seconds.
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True, task_manager=manager)


def assert_loglikelihoods_are_the_models(lm, results) -> None:
    model = build_preset_model("tiny-random", torch.float32).eval()
    mc = results["samples"]["toy_mc"]
    assert len(mc) == len(QUESTIONS)
    for sample in mc:
        for (context, continuation), (loglikelihood, _is_greedy) in zip(
                [r for r in sample["arguments"]], [r[0] for r in sample["resps"]]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            logp = EagerSequence(model, len(ids) + 1).extend(ids).log_softmax(dim=-1)
            expected = sum(logp[len(context_ids) - 1 + k, t].item() for k, t in enumerate(continuation_ids))
            assert abs(loglikelihood - expected) < 1e-4, (context, continuation, loglikelihood, expected)
    assert "acc,none" in results["results"]["toy_mc"]


def test_local_completions_loglikelihoods_equal_the_models(served, tmp_path, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    offline(monkeypatch, tmp_path)
    url, runner, batches = served
    write_tokenizer(tmp_path / "tokenizer")
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, tokenizer=str(tmp_path / "tokenizer"),
                             tokenizer_backend="huggingface", batch_size=4, max_length=256, max_retries=1)
    results = evaluate(lm, tmp_path, ["toy_mc", "toy_gen"])
    assert_loglikelihoods_are_the_models(lm, results)
    assert max(batches) == 4  # batch_size 4: lists of four prompts per request

    generated = results["samples"]["toy_gen"]
    assert len(generated) == len(QUESTIONS)
    for sample in generated:
        context = sample["arguments"][0][0]
        alone = runner.generate(lm.tok_encode(context), max_new_tokens=8, stop_strings=("\n",))
        assert sample["resps"][0][0] == alone.text
    assert "exact_match,none" in results["results"]["toy_gen"]


def test_local_completions_tokenizes_through_the_server_by_default(served, tmp_path, monkeypatch):
    """With no tokenizer named, lm-eval finds the server's /tokenizer_info and /tokenize and tokenizes there,
    offline; without them it looks for a Hugging Face tokenizer named as the model, and fails offline."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    offline(monkeypatch, tmp_path)
    url, runner, _ = served
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, batch_size=4, max_length=256,
                             max_retries=1)
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode("Snow is") == runner.tokenizer.encode("Snow is", add_bos=False)
    assert lm.eot_token_id == runner.tokenizer.eos_token_ids[0] and lm.prefix_token_id == 256
    assert_loglikelihoods_are_the_models(lm, evaluate(lm, tmp_path, ["toy_mc"]))
