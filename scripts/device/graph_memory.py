"""On a GPU: device memory of the CUDA graphs of every static width, against the widest graph alone.

Usage: python scripts/device/graph_memory.py ARTIFACT.pt2
Each configuration runs in a fresh process (a fresh CUDA context): load the artifact, allocate a small KV
pool, then capture either the widest static method alone or every static method (sharing one memory pool,
widest first, as the runtime does). Two measures: the graphs' pool (the allocator's reserved bytes after the
capture, once the warm-up's cached blocks are released) and everything the capture took from the device
(free memory before and after: also kernel modules and library workspaces). A table last.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

NUM_CELLS = 4097


def measure(path: str, which: str) -> dict:
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.executor import Executor, ExecutorConfig
    from pt2serve.runtime.graphs import capture_all
    from pt2serve.runtime.step import pack

    artifact = load_artifact(path)
    meta = artifact.metadata
    # Static methods without graphs: the pools exist, nothing is captured yet.
    executor = Executor(artifact, ExecutorConfig(num_cells=NUM_CELLS, use_cuda_graphs=False, use_static_methods=True))
    widths = sorted(meta.forward_sizes, reverse=True)
    chosen = widths[:1] if which == "widest" else widths
    idle = {f"forward_{w}": pack([], f"forward_{w}", w, meta.entries_of(w)) for w in chosen}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, reserved_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    captured, seconds = capture_all(artifact.run, idle, executor.pools, artifact.device, use_graph=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-up's blocks; the graphs' pool stays reserved
    return {
        "widths": chosen,
        "pool_bytes": torch.cuda.memory_reserved() - reserved_before,
        "device_bytes": free_before - torch.cuda.mem_get_info()[0],
        "seconds": seconds,
        "graphs": len(captured),
    }


def main() -> None:
    if len(sys.argv) == 3:  # a child: one configuration, JSON on the last line
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
        return
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    results = {}
    for which in ("widest", "all"):
        child = subprocess.run([sys.executable, __file__, sys.argv[1], which], capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"{which}: failed\n{child.stderr[-2000:]}")
        results[which] = json.loads(child.stdout.strip().splitlines()[-1])
    widest, every = results["widest"], results["all"]
    print(f"\n{sys.argv[1]}: graph memory, every static width against the widest alone")
    print("| captured | graphs | graph pool MB | device MB | capture s |\n|---|---:|---:|---:|---:|")
    for name, r in (("widest alone", widest), ("every width", every)):
        print(f"| {name} (forward_{r['widths'][0]}{'...' if len(r['widths']) > 1 else ''}) | {r['graphs']} | "
              f"{r['pool_bytes'] / 1e6:.1f} | {r['device_bytes'] / 1e6:.1f} | {r['seconds']:.2f} |")
    ratio = every["pool_bytes"] / max(widest["pool_bytes"], 1)
    print(f"every width / widest alone (graph pool): {ratio:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
