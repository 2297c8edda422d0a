"""From what a caller asks to a RequestSpec the engine can run, or a Pt2ServeError saying why not.

Everything here needs only what an artifact says about itself (vocabulary, context, pool size, whether it
speculates) and its tokenizer, not the engine: the runner checks requests on the caller's thread with it, and an
engine in another process (engine_process.py) checks them in the caller's process, before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from pt2serve.runtime.logprobs import MAX_TOP_LOGPROBS
from pt2serve.runtime.request import RequestSpec
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestChecks:
    tokenizer: Tokenizer | None
    vocab_size: int
    max_context: int
    pool_capacity: int  # cells in the KV pool: a request's prompt + output must fit
    speculates: bool  # the engine has a drafter
    num_draft_tokens: int
    grammars: GrammarCompiler

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Pt2ServeError("this artifact has no tokenizer: send token ids, not text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise Pt2ServeError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise Pt2ServeError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def spec(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: tuple[int, ...],
        stop_strings: tuple[str, ...],
        session_id: str | None,
        ignore_eos: bool,
        logprobs: int | None,
        prompt_logprobs: int | None,
        parent_prompt_ids: list[int] | None,
        grammar: GrammarSpec | CompiledGrammar | None,
        speculate: bool | None,
    ) -> RequestSpec:
        """The spec of a request that can run (Runner.submit says what each argument means)."""
        prompt_ids = self._prompt_ids(prompt)
        if parent_prompt_ids is not None and parent_prompt_ids != prompt_ids:
            raise Pt2ServeError("a request shares its parent's cells only with the parent's prompt")
        if parent_prompt_ids is not None and prompt_logprobs is not None:
            raise Pt2ServeError("a request that shares its parent's prompt does not compute it: ask the parent "
                                "for prompt_logprobs")
        if max_new_tokens < 1:
            raise Pt2ServeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        for name, top in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise Pt2ServeError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.max_context:
            raise Pt2ServeError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"artifact's max context of {self.max_context} tokens"
            )
        if total > self.pool_capacity:
            raise Pt2ServeError(f"{total} tokens exceed the KV pool ({self.pool_capacity} cells)")
        stops = set(stop_token_ids)
        if self.tokenizer is not None and not ignore_eos:
            stops.update(self.tokenizer.eos_token_ids)
        excluded = _not_speculating_because(sampling, logprobs, prompt_logprobs, parent_prompt_ids is not None,
                                            grammar is not None)
        if speculate and not self.speculates:
            raise Pt2ServeError("this server does not speculate: start it with --speculate ngram or dflash")
        if speculate and excluded:
            raise Pt2ServeError(f"speculative decoding does not combine with {excluded}: leave it out, or do not "
                                "ask to speculate")
        speculates = self.speculates and speculate is not False and not excluded
        compiled = self.grammars.compile(grammar) if isinstance(grammar, GrammarSpec) else grammar
        return RequestSpec(tuple(prompt_ids), max_new_tokens, sampling, frozenset(stops), tuple(stop_strings),
                           session_id, ignore_eos, logprobs, prompt_logprobs, compiled,
                           self.num_draft_tokens if speculates else 0)


def _not_speculating_because(sampling: SamplingParams, logprobs: int | None, prompt_logprobs: int | None,
                             has_parent: bool, has_grammar: bool) -> str | None:
    """What keeps a request from speculating, in words (None: nothing). Their logits or tokens need per-token
    host or device work that verified steps do not do."""
    reasons = [name for name, applies in (
        ("structured output", has_grammar),
        ("logprobs", logprobs is not None or prompt_logprobs is not None),
        ("penalties or logit_bias", sampling.has_penalties or bool(sampling.logit_bias)),
        ("min_tokens", sampling.min_tokens > 0),
        ("n > 1", has_parent),
    ) if applies]
    return ", ".join(reasons) or None
