"""Compiles a Triton kernel for an NVIDIA GPU on a machine without one (Triton ships ptxas and cuobjdump)
and counts the SASS instructions of each loop by opcode: how many instructions the inner loop spends per
value, read before any device time is spent. A loop is the span from a backward branch's target to it.

    python benchmarks/sass_loop.py tokenmill.kernels.gemv:w8a16_gemv_kernel \\
        --sig x=*bf16,w=*fp8e4nv,w_scale=*fp32,out=*bf16,N=i32,K=i32,stride_wn=i32 \\
        --const BLOCK_N=8,BLOCK_K=2048,SPLIT_K=1,EVEN_K=1,UNROLL=1,HAS_SCALE=1,VEC=16,PDL=0 \\
        --aligned x,w,w_scale,out,N,K,stride_wn \\
        --num-warps 8 [--arch 90] [--dump kernel.sass] [--ttgir kernel.ttgir]

A dtype constexpr is given as tl.<name> (A_DTYPE=tl.bfloat16).
--aligned names the arguments Triton would find divisible by 16 at launch (pointers from torch, sizes
and strides that are multiples of 16): the loads vectorize only where it knows.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# A cache of its own for each run: Triton's on-disk key for a kernel compiled this way does not tell
# apart constexprs that only trade values (FLAG_A=1, FLAG_B=0 against FLAG_A=0, FLAG_B=1), and a run
# would count another variant's SASS.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sass_loop-")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _pairs(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def _constant(value: str):
    if value.startswith("tl."):  # a dtype constexpr: tl.bfloat16, tl.float32, ...
        import triton.language as tl

        return getattr(tl, value[3:])
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """[(instructions, opcode counts)] for each backward branch's span."""
    code = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2).strip()))
    index = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            start = index[int(target.group(1), 16)]
            ops = collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in code[start : i + 1]
            )
            found.append((i - start + 1, ops))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", help="module:function")
    parser.add_argument("--sig", required=True, help="name=type,... for the runtime arguments")
    parser.add_argument("--const", default="", help="name=value,... for the constexprs")
    parser.add_argument("--aligned", default="", help="arguments divisible by 16")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=1)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dump", type=Path, help="write the whole SASS here")
    parser.add_argument("--ttgir", type=Path, help="write Triton's GPU IR here (its layout conversions)")
    args = parser.parse_args()
    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    signature = _pairs(args.sig)
    constants = {k: _constant(v) for k, v in _pairs(args.const).items()}
    signature.update({k: "constexpr" for k in constants})
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in args.aligned.split(",") if a}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": args.num_warps, "num_stages": args.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        command = [str(cuobjdump), "-sass", cubin.name]
        sass = subprocess.run(command, capture_output=True, text=True, check=True)
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True)
    resources = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", usage.stdout)
    if resources:
        registers, shared, local = resources.groups()
        print(f"registers {registers}, shared {shared} bytes, local {local} bytes")
    if args.dump:
        args.dump.write_text(sass.stdout)
    if args.ttgir:
        args.ttgir.write_text(compiled.asm["ttgir"])
    for count, ops in loops(sass.stdout):
        print(f"loop of {count} instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
