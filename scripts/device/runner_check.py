"""On a GPU: the runner (one step in flight, decodes fed by in-flight samples on the device) gives toy-greedy's
designed tokens for a mixed load, seeded sampling repeats, and the pool ends empty.

Usage: python scripts/device/runner_check.py ARTIFACT.pt2 (a toy-greedy export for the GPU)
Prints one table row per check and PASS/FAIL last (non-zero exit on a failure).
"""

from __future__ import annotations

import random
import sys
import time

from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import SamplingParams


def main() -> None:
    rows = []
    for budget in (None, 64, 7):  # the default budget, the widest static width, narrow steps that slice prompts
        runner = open_runner(sys.argv[1], executor_config=ExecutorConfig(num_cells=4097),
                             runner_config=RunnerConfig(token_budget=budget))
        try:
            rng = random.Random(budget or 0)
            prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(64)]
            lengths = [rng.randint(1, 40) for _ in prompts]
            started = time.perf_counter()
            handles = [runner.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
            wrong = sum(h.result(timeout=300).token_ids != toy_greedy_continuation(p, n)
                        for h, p, n in zip(handles, prompts, lengths))
            seconds = time.perf_counter() - started
            seeded = SamplingParams(temperature=1.0, top_k=20, seed=7)
            first = runner.generate([5, 6, 7], max_new_tokens=24, sampling=seeded, ignore_eos=True).token_ids
            again = runner.generate([5, 6, 7], max_new_tokens=24, sampling=seeded, ignore_eos=True).token_ids
            deadline = time.monotonic() + 10
            while runner.num_active and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            used = runner.executor.allocator.num_used
            ok = wrong == 0 and first == again and used == 0
            rows.append((budget or "default", len(prompts), wrong, first == again, used, f"{seconds:.2f}", ok))
        finally:
            runner.close()
    print(f"{'budget':>8} {'requests':>8} {'wrong':>6} {'seeded repeat':>13} {'cells left':>10} {'seconds':>8}")
    for budget, count, wrong, repeat, used, seconds, _ in rows:
        print(f"{budget!s:>8} {count:>8} {wrong:>6} {repeat!s:>13} {used:>10} {seconds:>8}")
    passed = all(row[-1] for row in rows)
    print("PASS" if passed else "FAIL")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
