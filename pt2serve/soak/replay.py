"""Seeded sampled answers checked exactly: each is asked again once the traffic is over, alone on an idle
server, and must come back the same.

Sampling is keyed by (seed, position), so a seeded request's answer depends only on its logits; the replay
alone runs on other widths and in other company than the request did under load. A sampled request turned
greedy still agrees with its replay, so on a designed preset the answers must also depart from the greedy
design: the soak samples there at a temperature where about one designed token in eight is not drawn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pt2serve.soak.calls import Target, post
from pt2serve.soak.oracle import SampledLog

REPLAY_KIND = "sampled replay"


@dataclass(frozen=True)
class SampledReplay:
    replayed: int
    identical: int
    recorded: int
    departing: int
    differences: tuple[str, ...]  # the first few


async def replay_sampled(target: Target, log: SampledLog, count: int) -> SampledReplay:
    """Up to `count` of the logged answers, spread over the run, asked again one at a time."""
    chosen = log.answers[:: max(1, len(log.answers) // count)][:count] if count else []
    alone = dataclasses.replace(target, sampled=None)  # the replays are not logged themselves
    identical, differences = 0, []
    for ask, got in chosen:
        outcome, again = await post(alone, REPLAY_KIND, ask)
        if again is None or outcome.problem:
            differences.append(f"seed {ask.seed}: the replay answered {outcome.status}: {outcome.problem}")
            continue
        # Streamed answers carry no ids: those compare by text.
        if again.text == got.text and (got.token_ids is None or again.token_ids == got.token_ids):
            identical += 1
        else:
            differences.append(f"seed {ask.seed}: {got.token_ids or got.text!r} under load, "
                               f"{again.token_ids if got.token_ids is not None else again.text!r} alone")
    return SampledReplay(len(chosen), identical, len(log.answers), log.departing, tuple(differences[:3]))
