"""Compile the C++ sources that hold AVX2 code with that path disabled (-DRLVR_FAST_NO_AVX2: what
aarch64 builds, e.g. GH200's Grace, compile) and check that the scalar kernels agree with the
installed extension. Only those sources are built, as one translation unit with a module that
registers just them (each file would parse torch's headers again), to keep ``make test`` short;
the others have no architecture-specific code.

    python scripts/check_scalar_build.py [--build-dir build/scalar]

On x86-64 the installed ``rlvr_fast._C`` runs the AVX2 + FMA kernels; this build runs the scalar
fallback on the same inputs. Zero-gradient AdamW must stay bitwise equal (the fallback is the
same arithmetic, fmaf instead of vfmadd); paged attention agrees up to float32 rounding (the
AVX2 version sums in another order). Exit status 1 names the first disagreement.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from rlvr_fast import _C as installed
from rlvr_fast.kernels.paged_attention import paged_prefill_attention_reference

ROOT = Path(__file__).resolve().parents[1]
# -O0: parsing torch's headers dominates the build either way, and optimising would only lengthen
# make test; with -ffp-contract=off the scalar arithmetic is the same IEEE operations at any -O.
FLAGS = ["-O0", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-DRLVR_FAST_NO_AVX2"]


# The sources with an AVX2 variant (``#if RLVR_FAST_AVX2``) and their register functions.
AVX2_SOURCES = {
    "zero_grad_adamw.cpp": "register_zero_grad_adamw",
    "paged_attention.cpp": "register_paged_attention",
}


def build(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with_avx2 = sorted(
        p.name for p in (ROOT / "csrc").glob("*.cpp") if "RLVR_FAST_AVX2" in p.read_text()
    )
    if with_avx2 != sorted(AVX2_SOURCES):
        raise SystemExit(f"csrc/ files with AVX2 code are {with_avx2}; update AVX2_SOURCES")
    module = directory / "scalar_module.cpp"
    module.write_text(
        "".join(f'#include "{ROOT / "csrc" / name}"\n' for name in AVX2_SOURCES)
        + "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
        + "".join(f"  {name}(m);\n" for name in AVX2_SOURCES.values())
        + "}\n"
    )
    return load(
        name="rlvr_fast_scalar_C",
        sources=[str(module)],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )


def check_zero_grad_adamw(scalar) -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [torch.randn(100_003, generator=generator).to(dtype) for _ in range(3)]
        tensors[2] = tensors[2].abs()
        outputs = []
        for module in (installed, scalar):
            param, exp_avg, exp_avg_sq = (t.clone() for t in tensors)
            module.zero_grad_adamw_(
                param,
                exp_avg,
                exp_avg_sq,
                0.1,
                0.999,
                1e-8,
                [0.9999, 0.9999],
                [0.03, 0.04],
                [-1e-3, -1e-3],
            )
            outputs.append((param, exp_avg, exp_avg_sq))
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), *outputs):
            if not torch.equal(a, b):
                raise AssertionError(f"zero_grad_adamw_ {dtype}: scalar {name} differs bitwise")


def check_paged_attention(scalar) -> None:
    generator = torch.Generator().manual_seed(1)
    rows, q_heads, kv_heads, dim, block_size, blocks = 3, 4, 2, 64, 16, 12
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=generator)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=generator)
    tables = torch.randperm(blocks, generator=generator, dtype=torch.int32)[: rows * 4]
    tables = tables.view(rows, 4)
    lens = torch.tensor([[37], [64], [5]])
    q = torch.randn(rows, q_heads, 1, dim, generator=generator)
    reference = paged_prefill_attention_reference(q, k_cache, v_cache, tables, lens)
    for label, module in (("installed", installed), ("scalar", scalar)):
        out = module.paged_attention_cpu(q, k_cache, v_cache, tables, lens)
        if not torch.allclose(out, reference, rtol=1e-5, atol=1e-5):
            raise AssertionError(f"paged_attention_cpu ({label}) differs from the reference")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "scalar")
    args = parser.parse_args()
    started = time.perf_counter()
    scalar = build(args.build_dir)
    print(f"scalar build (-DRLVR_FAST_NO_AVX2) in {time.perf_counter() - started:.0f} s")
    try:
        check_zero_grad_adamw(scalar)
        check_paged_attention(scalar)
    except AssertionError as err:
        print(f"FAIL: {err}", file=sys.stderr)
        return 1
    print("scalar kernels agree with the installed extension")
    return 0


if __name__ == "__main__":
    sys.exit(main())
