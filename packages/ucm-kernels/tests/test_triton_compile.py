"""The Triton kernel compiles for a real GPU target, with 16-byte accesses.

The interpreter runs the kernel's Python semantics, not the compiler: this compiles it
ahead of time for sm_90 (no GPU needed: Triton ships ptxas) and checks the PTX for vector
loads and stores, so that a hint the compiler drops (an alignment hint on an expression
that folds away, say) shows up here rather than as a slow kernel on the GPU machine.
Runs in a subprocess because this process has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ucm.kernels.triton_copy import _copy_kernel

out = {}
for gather in (1, 0):
    for parts, head_dim, block_d, bits, align in ((1, 256, 256, "i16", 8), (2, 128, 128, "i16", 8),
                                                  (1, 576, 256, "i8", 16)):
        names = _copy_kernel.arg_names
        ptrs = dict(cache_base="*" + bits, buf_base="*" + bits, cache_offs="*i64",
                    buf_offs="*i64", pay_offs="*i64", ids="*i64")
        const = dict(PARTS=parts, HEAD_DIM=head_dim, BLOCK_T=16, BLOCK_D=block_d, ALIGN=align,
                     GATHER=gather, stride_d=1)
        sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
        div16 = list(ptrs) + ["stride_b", "stride_h", "stride_n", "stride_p"]
        src = ASTSource(
            fn=_copy_kernel, signature=sig,
            constexprs={(names.index(k),): v for k, v in const.items()},
            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16},
        )
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        key = f"gather={gather} parts={parts} head_dim={head_dim} {bits}"
        out[key] = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)))
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_with_vector_accesses() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silence a 3.9 notice; a copy has no FP math
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip(f"this triton build cannot compile for CUDA here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, found in ops.items():
        assert "ld.global.v4.b32" in found and "st.global.v4.b32" in found, (key, found)
