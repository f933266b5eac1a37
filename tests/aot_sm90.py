"""Compile a Triton kernel ahead of time for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's own pipeline runs down to a cubin with the ptxas it bundles; Triton already runs that
ptxas with ``-v``, and its log (registers and spills) is read from Triton's dump of it rather than
from a second ptxas run (ptxas is most of the time: 30 s of the sampler's draw kernel). The argument types and the 16-divisibility hints are the
ones Triton's launcher would give at the shapes a test names (pointers from torch's allocator and
ints that are multiples of 16 get the hint). It runs in a subprocess because the test session
runs Triton in the interpreter (TRITON_INTERPRET=1), where ``@triton.jit`` functions cannot be
compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
COMPILE = r"""
import contextlib, importlib, io, json, sys
import triton, triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
# Compile even when Triton's cache holds the kernel: the ptxas log comes only from a compile.
knobs.compilation.always_compile = True
knobs.nvidia.dump_ptxas_log = True
request = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(request["module"]), request["kernel"])
constexprs = {name: getattr(tl, value[3:]) if str(value).startswith("tl.") else value
              for name, value in request["constexprs"].items()}
signature = {**request["signature"], **{name: "constexpr" for name in constexprs}}
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
         for name in request["divisible"]}
ptxas_log = io.StringIO()
with contextlib.redirect_stdout(ptxas_log):
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options=request["options"])
print(json.dumps({"ptx": compiled.asm["ptx"], "cubin_bytes": len(compiled.asm["cubin"]),
                  "ptxas_info": ptxas_log.getvalue()}))
"""


@dataclass
class Compiled:
    ptx: str
    cubin_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int

    def count(self, pattern: str) -> int:
        """Occurrences of a regular expression in the PTX."""
        return len(re.findall(pattern, self.ptx))

    def narrow_offsets(self) -> list[str]:
        """The 32-bit integer products of the PTX that scale a program id or a loaded index into
        a global memory address (``narrow_address_products``): empty when every such offset is
        computed in 64 bits."""
        return narrow_address_products(self.ptx)


REGISTER = re.compile(r"%[a-z]+\d*")
# A 32-bit integer product: it wraps at 2^31 where a 64-bit one would not.
NARROW_PRODUCT = re.compile(r"^(mul|mad)(\.lo)?\.[su]32$|^(mul|mad)24|^shl\.b32$")
GLOBAL_ACCESS = re.compile(r"^(ld|st|atom|red)\.global")


def _instructions(ptx: str) -> list[tuple[str, str, list[str], list[str], list[str]]]:
    """(line, opcode, destination registers, source registers, address registers) per
    instruction; a predicate guard is dropped, braces and brackets name registers."""
    parsed = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line.endswith(";"):
            continue
        line = re.sub(r"^@!?%p\d+\s+", "", line[:-1])
        opcode, _, rest = line.partition(" ")
        operands = rest.strip()
        addresses = REGISTER.findall(" ".join(re.findall(r"\[([^\]]*)\]", operands)))
        outside = re.sub(r"\[[^\]]*\]", "", operands)
        if opcode.startswith("st."):
            parsed.append((line, opcode, [], REGISTER.findall(outside), addresses))
            continue
        head, _, tail = outside.partition(",")
        if head.strip().startswith("{"):  # a vector destination: { %r1, %r2 }, ...
            head, _, tail = outside.partition("}")
        parsed.append((line, opcode, REGISTER.findall(head), REGISTER.findall(tail), addresses))
    return parsed


def narrow_address_products(ptx: str) -> list[str]:
    """PTX lines of 32-bit integer multiplies or shifts that (a) depend on a program id
    (``%ctaid``) or on a value loaded from global memory (a block id, a target, an address) and
    (b) feed the address of a global load or store: the products that overflow past 2^31 on
    large tensors. A product of thread-local offsets (``tl.arange`` times a stride) is bounded by
    the block shape and is not one."""
    instructions = _instructions(ptx)
    scaled: set[str] = set()
    for line, opcode, dsts, _, _ in instructions:
        if "%ctaid" in line or GLOBAL_ACCESS.match(opcode):
            scaled.update(dsts)
    changed = True
    while changed:  # forward: everything computed from a scaled value (loops included)
        changed = False
        for _, opcode, dsts, srcs, _ in instructions:
            if not GLOBAL_ACCESS.match(opcode) and scaled.intersection(srcs):
                changed |= not scaled.issuperset(dsts)
                scaled.update(dsts)
    feeding = {r for _, opcode, _, _, a in instructions if GLOBAL_ACCESS.match(opcode) for r in a}
    changed = True
    while changed:  # backward: every register an address is computed from
        changed = False
        for _, opcode, dsts, srcs, _ in instructions:
            if feeding.intersection(dsts) and not GLOBAL_ACCESS.match(opcode):
                changed |= not feeding.issuperset(srcs)
                feeding.update(srcs)
    return [
        line
        for line, opcode, dsts, srcs, _ in instructions
        if NARROW_PRODUCT.match(opcode)
        and feeding.intersection(dsts)
        and scaled.intersection(srcs + dsts)
    ]


def compile_for_sm90(
    module: str,
    kernel: str,
    signature: dict[str, str],
    constexprs: dict,
    *,
    divisible: tuple[str, ...] = (),
    options: dict | None = None,
) -> Compiled:
    """``module.kernel`` compiled for sm_90. ``signature`` maps run-time arguments to Triton
    types ("*bf16", "i32", ...); ``constexprs`` holds the compile-time ones (a "tl.NAME" string
    stands for ``triton.language.NAME``); ``divisible`` names the arguments Triton's launcher
    would mark divisible by 16."""
    pytest.importorskip("triton.backends.nvidia")
    request = dict(
        module=module,
        kernel=kernel,
        signature=signature,
        constexprs=constexprs,
        divisible=list(divisible),
        options=options or {},
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Test modules may hold kernels too (the 64-bit offset checks' control).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    info = result["ptxas_info"]
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    registers = re.search(r"Used (\d+) registers", info)
    assert spills and registers, info
    return Compiled(
        result["ptx"],
        result["cubin_bytes"],
        int(registers.group(1)),
        int(spills.group(1)),
        int(spills.group(2)),
    )


def parse_launch_for_sm90(kernel, args: tuple, kwargs: dict):
    """What compiled Triton does with ``kernel[grid](*args, **kwargs)`` before it compiles, for an
    sm_90 target: bind the arguments, specialise them, parse the launch options with the CUDA
    backend's parser and refuse every keyword that is neither a kernel parameter nor an option
    (``KeyError``; the interpreter drops such keywords silently). ``kernel`` is the interpreted
    kernel (its ``fn`` is the Python function). Returns (options, signature)."""
    pytest.importorskip("triton.backends.nvidia")
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    compiled = JITFunction(kernel.fn)
    binder = create_function_from_signature(compiled.signature, compiled.params, backend)
    # What JITFunction.run adds to every launch's keywords.
    kwargs = {
        **kwargs,
        "debug": kwargs.get("debug", False),
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
    }
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, _, _ = compiled._pack_args(backend, kwargs, bound, specialization, options)
    return options, signature
