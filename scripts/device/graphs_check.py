"""On a GPU: the same random mixed steps with CUDA graphs on and off give identical tokens.

Usage: python scripts/device/graphs_check.py ARTIFACT.pt2 [PRESET]   (an export of a designed preset for the GPU:
toy-greedy, the default, or toy-greedy-8b, the 8B's shape)
Fresh cells are filled with NaN first, so a read of a cell before its write shows up as a wrong token.
Prints load/capture time and memory, then one table row per configuration. A step whose tokens differ
from the designed ones is diagnosed at once, from the pool as it was before the step: the executor again,
its static path with the host's argmax next to the device sampler's, then the compiled method and the eager
model on copies of the pool, with each output row's top two logits.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from pt2serve.model.presets import build_preset_model, toy_greedy_continuation
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, regions

WIDTHS = list(range(1, 66)) + [96, 97]
GREEDY = SamplingParams()


def run_widths(executor: Executor, seed: int, preset: str) -> tuple[list, list, float]:
    """Teacher-forced random mixes of sequences; returns (tokens, methods, seconds)."""
    rng = np.random.default_rng(seed)
    outputs, methods = [], []
    widths = WIDTHS + [executor.max_step_tokens + 20]
    rng.shuffle(widths)
    started = time.perf_counter()
    for width in widths:
        chunks, held = [], []
        remaining = width
        while remaining:
            length = int(min(remaining, rng.integers(1, 12)))
            prompt = [int(rng.integers(0, 256))]
            truth = prompt + toy_greedy_continuation(prompt, 200)
            start = int(rng.integers(0, 40))
            cells = executor.allocator.allocate(start + length)
            # NaN in fresh cells: a read before the step's own write shows as a wrong token.
            index = torch.from_numpy(cells).to(executor.device)
            for pool in executor.pools:
                pool.index_fill_(0, index, float("nan"))
            held.append(cells)
            wants = bool(rng.integers(0, 2))
            # Context before `start` is written by an earlier step of the same sequence.
            if start:
                executor.step([Chunk(cells, tuple(truth[:start]), 0, None)])
            chunks.append(Chunk(cells, tuple(truth[start:start + length]), start, GREEDY if wants else None))
            remaining -= length
            outputs.append(("expect", truth[start + length] if wants else None))
        before = [pool.clone() for pool in executor.pools]
        result = executor.step(chunks)
        outputs.extend(("got", t) for t in result.tokens)
        step_methods = tuple(c.method for c in result.calls)
        methods.append(step_methods)
        expected = [v for k, v in outputs[-2 * len(chunks):-len(chunks)]]
        wrong = sum(e != g for e, g in zip(expected, result.tokens))
        if wrong:
            print(f"width {width} via {'+'.join(step_methods)}: {wrong} of {len(chunks)} outputs differ: "
                  f"designed {expected}, got {list(result.tokens)}")
            diagnose(executor, chunks, expected, before, preset)
        for cells in held:
            executor.allocator.free(cells)
    if executor.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, methods, time.perf_counter() - started


def diagnose(executor: Executor, chunks: list[Chunk], expected: list, before: list[torch.Tensor],
             preset: str) -> None:
    """Re-run a failed step from the pool as it was before it: the executor's own path again, then each
    piece compiled (no graph, fresh input tensors) and eager on copies; print each output row."""
    def restore() -> None:
        for pool, saved in zip(executor.pools, before):
            pool.copy_(saved)

    restore()
    print(f"  executor again: {list(executor.step(chunks).tokens)}")
    restore()
    artifact, meta = executor.artifact, executor.artifact.metadata
    model = build_preset_model(preset, meta.kv_dtype, executor.device).eval()
    for piece, call in executor.method_calls(chunks):
        method = call.method
        print(f"  {method}: sizes {call.sizes}")
        for name, region in zip(("tokens", "positions", "write_cells", "token_seq", "seq_indptr", "logit_rows"),
                                [r for i, r in enumerate(regions(call.host, call.sizes)) if i != 5]):
            print(f"    {name}: {region.tolist()}")
        if call.width is not None:
            static = executor._static[method]
            static.load(call.host)
            logits = static.run()[: len(call.sampled_chunks)]
            staged = torch.equal(static.buffers.device_buffer.cpu(), torch.from_numpy(call.host))
            sampled = executor._sample(logits, [dict(piece)[i] for i in call.sampled_chunks]).tolist()
            print(f"    static path: buffer == host {staged}, host argmax {logits.argmax(-1).tolist()}, "
                  f"device sampler {sampled}, logits stride {logits.stride()}, NaN {bool(logits.isnan().any())}")
            restore()
        inputs = call.device_inputs(executor.device)
        half = len(executor.pools) // 2
        compiled_pools = [p.clone() for p in executor.pools]
        eager_pools = [p.clone() for p in executor.pools]
        compiled = artifact.run(method, [*inputs, *compiled_pools])[0].float()
        with torch.no_grad():
            eager = model(*[t.clone() for t in inputs], eager_pools[:half], eager_pools[half:]).float()
        written = torch.from_numpy(regions(call.host, call.sizes)[2].copy()).to(executor.device)
        dpool = max((a[written] - b[written]).abs().max().item() for a, b in zip(compiled_pools, eager_pools))
        print(f"    max |dpool| in written cells, compiled vs eager: {dpool:.3e}; "
              f"NaN in compiled logits: {bool(compiled.isnan().any())}")
        for row, index in enumerate(call.sampled_chunks):
            chunk = dict(piece)[index]
            top_c, top_e = compiled[row].topk(2), eager[row].topk(2)
            print(f"    chunk {index} start {chunk.start} len {len(chunk.tokens)}: designed {expected[index]} "
                  f"compiled {top_c.indices.tolist()} {top_c.values.tolist()} "
                  f"eager {top_e.indices.tolist()} {top_e.values.tolist()}")


def main() -> None:
    path = sys.argv[1]
    preset = sys.argv[2] if len(sys.argv) > 2 else "toy-greedy"
    artifact = load_artifact(path)
    print(f"load: {artifact.report.load_seconds:.2f} s, weights {artifact.report.weight_bytes / 1e6:.1f} MB")
    rows = []
    results = {}
    # The widest step's sequences hold about 4 cells per token (up to 40 of context each): 16 leaves room.
    meta = artifact.metadata
    num_cells = min(meta.max_cells + 1, max(4096, 16 * (meta.max_step_tokens + 20)))
    for use_graphs in (True, False):
        executor = Executor(artifact, ExecutorConfig(num_cells=num_cells, use_cuda_graphs=use_graphs,
                                                     use_static_methods=True))
        mem = executor.memory
        outputs, methods, seconds = run_widths(executor, seed=0, preset=preset)
        expected = [v for k, v in outputs if k == "expect"]
        got = [v for k, v in outputs if k == "got"]
        results[use_graphs] = got
        rows.append((use_graphs, mem.capture_seconds, mem.graph_bytes / 1e6, mem.pool_bytes / 1e6,
                     got == expected, seconds))
        del executor
    print(f"{'graphs':>6} {'capture s':>9} {'graph MB':>8} {'pool MB':>8} {'= designed':>10} {'run s':>6}")
    for graphs, capture, graph_mb, pool_mb, ok, seconds in rows:
        print(f"{str(graphs):>6} {capture:9.2f} {graph_mb:8.1f} {pool_mb:8.1f} {str(ok):>10} {seconds:6.2f}")
    same = results[True] == results[False]
    designed = all(row[4] for row in rows)
    print("graphs on == graphs off:", same)
    print("PASS" if same and designed else "FAIL")
    sys.exit(0 if same and designed else 1)


if __name__ == "__main__":
    main()
