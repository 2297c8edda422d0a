"""Instructions per weight of the small-M quantized linear kernel, compiled for sm_90 without a GPU.

The kernel at decode widths is bound by instructions per weight, not by memory (an H200 issues about
132 SMs x 128 lanes x 1.98 GHz = 3.3e13 thread-instructions/s against 4.4 TB/s of packed bytes: int4
reaches its floor at ~3.8 instructions per weight, int8 at ~7.5). This compiles the kernel for sm_90 with
Triton's own ptxas, finds the steady-state K loop in the SASS (the longest backward branch) and prints,
per config, the loop's instructions per thread, the weights a thread handles per iteration and their
ratio. It needs no GPU; run it without TRITON_INTERPRET:

    python scripts/quant_kernel_ptx.py [--ptx] [--breakdown] [--candidates M]

--ptx also counts the PTX loop (before ptxas); --breakdown lists the SASS loop's opcodes; --candidates M
compiles every launch config of a width of M rows instead. A config whose registers spill says so.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels instead of interpreting them")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as on the GPU (Triton 3.6 fuses by default)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from pt2serve.kernels import quant_linear_triton as qlt  # noqa: E402
from pt2serve.kernels.linear_configs import QuantLaunchConfig  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
THREADS_PER_WARP = 32


@dataclass(frozen=True)
class Case:
    """One kernel launch at a real projection's shape (Llama 3 8B gate_up: N 28672, K 4096)."""

    label: str
    bits: int
    has_zeros: bool
    num_rows: int
    config: QuantLaunchConfig
    group_size: int = 128
    n: int = 28672
    k: int = 4096


def default_case(label: str, bits: int, has_zeros: bool, num_rows: int, use_dot: bool | None = None) -> Case:
    """The default config small_m_config picks (or its first of the given kind) at this shape."""
    configs = qlt.small_m_candidates(num_rows, 28672, 4096, bits, qlt.DEFAULT_NUM_SMS)
    if use_dot is not None:
        configs = [c for c in configs if c.use_dot == use_dot]
    return Case(label, bits, has_zeros, num_rows, configs[0])


def representative_cases() -> list[Case]:
    return [
        default_case("int4 g128", 4, False, 1),
        default_case("int4 g128 zeros", 4, True, 1),
        default_case("int8 g128", 8, False, 1),
        default_case("int8 g128 zeros", 8, True, 1),
        default_case("int4 g128 m4", 4, False, 4),
        default_case("int4 g128 dot", 4, False, 16, use_dot=True),
        default_case("int8 g128 dot", 8, False, 16, use_dot=True),
    ]


def candidate_cases(num_rows: int) -> list[Case]:
    """Every launch config small_m_candidates offers at this width, int4 and int8 without zeros."""
    return [Case(f"int{bits} g128", bits, False, num_rows, config)
            for bits in (4, 8)
            for config in qlt.small_m_candidates(num_rows, 28672, 4096, bits, qlt.DEFAULT_NUM_SMS)]


def compile_case(case: Case):
    """Compiles quant_linear_small_m_kernel as launch_small_m would launch it for bf16 activations."""
    config = case.config
    row_bytes = case.k * case.bits // 8
    bytes_per_split = qlt._bytes_per_split(row_bytes, config.split_k, config.block_bytes)
    out_type = "*bf16" if config.split_k == 1 else "*fp32"
    pointers = {"x_ptr": "*bf16", "qweight_ptr": "*u8", "scales_ptr": "*bf16",
                "zeros_ptr": "*u8" if case.has_zeros else "*bf16", "perm_ptr": "*u8", "out_ptr": out_type}
    ints = {"M": case.num_rows, "N": case.n, "K": case.k, "row_bytes": row_bytes,
            "num_groups": triton.cdiv(case.k, case.group_size), "bytes_per_split": bytes_per_split,
            "stride_xm": case.k, "stride_qn": row_bytes}
    constexprs = {
        "BITS": case.bits, "GROUP_SIZE": case.group_size, "HAS_ZEROS": case.has_zeros, "HAS_PERM": False,
        "UNIFORM_GROUPS": qlt._uniform_groups(case.bits, case.k, case.group_size, config.block_bytes),
        "USE_DOT": config.use_dot, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
        "BLOCK_B": config.block_bytes, "EVEN_B": qlt._whole_steps(row_bytes, config.block_bytes),
        "DOT_PRECISION": "tf32", "X_DIRECT": config.x_direct,
    }
    kernel = qlt.quant_linear_small_m_kernel
    signature = {**pointers, **{name: "i32" for name in ints}, **{name: "constexpr" for name in constexprs}}
    signature = {name: signature[name] for name in kernel.arg_names}
    # What the launcher's specialization would see: pointers from the allocator (16-byte aligned) and
    # ints that are multiples of 16.
    divisible = [name for name in pointers] + [name for name, value in ints.items() if value % 16 == 0]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS, from the cuobjdump that ships with Triton."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.check_output([cuobjdump, "-sass", file.name], text=True)
    lines = []
    for match in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text):
        lines.append((int(match.group(1), 16), match.group(2).strip()))
    return lines


def sass_loop(lines: list[tuple[int, str]]) -> list[str]:
    """The instructions of the longest loop: from a backward branch's target to the branch."""
    best: list[str] = []
    for index, (address, instruction) in enumerate(lines):
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", instruction)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        target = int(branch.group(1), 16)
        body = [ins for addr, ins in lines[: index + 1] if addr >= target]
        if len(body) > len(best):
            best = body
    return [ins for ins in best if not ins.startswith("NOP")]


def ptx_loop(ptx: str) -> list[str]:
    """The PTX instructions of the longest loop: from a label to the last branch back to it."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
    labels = {line[:-1]: index for index, line in enumerate(lines) if re.fullmatch(r"\$L__\w+:", line)}
    best: list[str] = []
    for index, line in enumerate(lines):
        branch = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if branch and labels.get(branch.group(1), index) < index:
            body = lines[labels[branch.group(1)] : index + 1]
            body = [ins for ins in body if ins and not ins.endswith(":") and not ins.startswith((".", "{", "}"))]
            if len(body) > len(best):
                best = body
    return best


def weights_per_thread(case: Case) -> float:
    """Weights one thread dequantizes per loop iteration (each is multiplied with every row of x)."""
    config = case.config
    weights = config.block_n * config.block_bytes * 8 // case.bits
    return weights / (config.num_warps * THREADS_PER_WARP)


def opcode(instruction: str) -> str:
    instruction = re.sub(r"^@!?U?P\w+\s+", "", instruction)
    return instruction.split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptx", action="store_true", help="also count the PTX loop")
    parser.add_argument("--breakdown", action="store_true", help="list the SASS loop's opcodes per config")
    parser.add_argument("--candidates", type=int, metavar="M",
                        help="every launch config a width of M rows may take, instead of the representative ones")
    args = parser.parse_args()
    cases = representative_cases() if args.candidates is None else candidate_cases(args.candidates)
    header = f"{'config':<18} {'launch config':<34} {'loop SASS':>9} {'weights/thr':>11} {'SASS/weight':>11}"
    if args.ptx:
        header += f" {'loop PTX':>8} {'PTX/weight':>10}"
    print(header)
    for case in cases:
        compiled = compile_case(case)
        lines = sass_lines(compiled.asm["cubin"])
        loop = sass_loop(lines)
        weights = weights_per_thread(case)
        row = f"{case.label:<18} {case.config.name:<34} {len(loop):>9} {weights:>11g} {len(loop) / weights:>11.2f}"
        if args.ptx:
            ptx = ptx_loop(compiled.asm["ptx"])
            row += f" {len(ptx):>8} {len(ptx) / weights:>10.2f}"
        local = sum(1 for _, ins in lines if re.match(r"(@!?P\w+\s+)?(STL|LDL)\b", ins))
        if local:
            row += f"  ({local} local loads/stores: registers spilled)"
        print(row, flush=True)
        if args.breakdown:
            counts = collections.Counter(opcode(ins) for ins in loop)
            print("    " + ", ".join(f"{name} {count}" for name, count in counts.most_common()))


if __name__ == "__main__":
    main()
