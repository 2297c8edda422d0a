"""The eager PyTorch peer: the sweep's own steps run through the uncompiled model on the artifact's weights.

A peer must do the same computation without the compiled artifact, and the model module is exactly that,
so this is the one place after export that imports it. It replays a measured step (the same chunks, the
same cells of the executor's pool, which is idle by then) the way `Executor.step` runs it: pack the inputs,
copy them to the device, run every layer (here one PyTorch op at a time, no CUDA graph), take the argmax
and bring the token ids to the host. The compiled path packs static steps with their fixed entry capacity;
the peer uses the dynamic layout (the real entries only), which favours the peer.
"""

from __future__ import annotations

import time

import torch

from pt2serve.bench.stats import median
from pt2serve.contract import FORWARD_OTHERS
from pt2serve.runtime.executor import Executor
from pt2serve.runtime.step import Chunk, pack, slice_step


class EagerPeer:
    def __init__(self, executor: Executor) -> None:
        from pt2serve.model.config import ModelConfig
        from pt2serve.model.kv_fp8 import install_kv_scales, kv_scales_in
        from pt2serve.model.model import Transformer
        from pt2serve.model.quant import install_from_record

        artifact = executor.artifact
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_dict(artifact.metadata.raw["model_config"]))
        quantization = artifact.metadata.raw.get("quantization")
        if quantization is not None:
            install_from_record(model, artifact.weights, quantization)
        kv_scales = kv_scales_in(artifact.weights, len(model.layers))  # FP8 cells: their scales are weights
        if kv_scales is not None:
            install_kv_scales(model, kv_scales)
        # The artifact's device weights themselves (assign: no copy); the rotary table is a buffer.
        state = {name: artifact.weights[name] for name in model.state_dict()}
        model.load_state_dict(state, assign=True)
        model.inv_freq = artifact.weights["inv_freq"]
        self.model = model.eval()
        self.device = executor.device
        self.max_step_tokens = executor.max_step_tokens
        half = len(executor.pools) // 2
        self.k_pools, self.v_pools = executor.pools[:half], executor.pools[half:]

    @torch.no_grad()
    def step(self, chunks: list[Chunk]) -> list[int]:
        """One step: the sampled (greedy) token of every chunk that asks for one."""
        tokens = []
        for piece in slice_step(chunks, self.max_step_tokens):
            call = pack(piece, FORWARD_OTHERS, None)
            logits = self.model(*call.device_inputs(self.device), self.k_pools, self.v_pools)
            tokens += logits[: len(call.sampled_chunks)].argmax(-1).tolist()
        return tokens

    def step_seconds(self, chunks: list[Chunk], repeats: int) -> float:
        """Median time of `repeats` runs of one step, after one untimed run."""
        self.step(chunks)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.step(chunks)
            times.append(time.perf_counter() - started)
        return median(times)
