"""Static performance report: what the sm_90 code of every kernel costs, measured without a GPU.

    python -m bench static                 # the table (markdown) on stdout
    python -m bench static --json r.json   # also every number, for tests and tools
    python -m bench static --no-cuda       # Triton kernels only (no nvcc needed)

**Triton**: every kernel variant is compiled for sm_90 with the specialisation a real
launch gets.  The launchers of ``ppo_fast.backends.triton.<op>`` run on ``meta`` tensors of
the target shapes (each op module's ``static_variants()``); the launch itself is intercepted
and handed to Triton's own binder, the code that turns a real launch's arguments into the
compiled signature: pointer and int types (ints
that fit are i32), ints equal to 1 made constexpr, and the divisibility-by-16 hints on
ints and pointers.  A meta tensor's address is 0, so its pointer gets the 16-byte hint a
fresh CUDA allocation (256-byte aligned) gets.  **CUDA**: ``csrc/cuda/*.cu`` compiled
with ``nvcc -cubin -arch=sm_90 -Xptxas -v``.

Per kernel: registers, spilled bytes (ptxas ``-v``), shared memory, 128-bit global
loads/stores (``LDG.E.128``/``STG.E.128`` in the SASS), and SASS instructions per element
in the hot loop: the loop is the span of the SASS's widest backward branch, and its
instruction count is divided by the elements each thread handles per iteration
(``BLOCK / (32 * num_warps)``); a kernel without a loop counts all its instructions.

**The bound this implies** (H200 SXM): 132 SMs x 4 schedulers issue at most one warp
instruction per cycle each at 1.98 GHz, i.e. 3.35e13 thread-instructions/s.  A kernel that
issues ``I`` instructions per element and moves ``B`` bytes per element can stream at most
``B * 3.35e13 / I`` bytes/s: that is its issue limit, reported beside the HBM3e peak of
4.8 TB/s.  It is an upper bound (perfect issue, no stalls): a kernel whose issue limit is
near the memory bandwidth will not reach that bandwidth.  A bf16 log-prob forward (2 bytes
per logit) becomes memory-bound below ~14 instructions per logit, so the budgets keep it
at <= 10 (<= 13 with the entropy) and the backward (2 bytes read + 2 written) at <= 8,
with the entropy gradient or without, leaving headroom for the stalls the model ignores.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]

SMS, SCHEDULERS, CLOCK_HZ, WARP = 132, 4, 1.98e9, 32
ISSUE_RATE = SMS * SCHEDULERS * CLOCK_HZ * WARP  # thread-instructions per second
HBM_PEAK = 4.8e12  # bytes per second

# The budgets the tests assert: instructions per logit in the log-prob kernels' hot loops,
# for 16- and 32-bit logits whose rows allow 16-byte loads (V % 8 == 0 for bf16).
BUDGETS = {
    "token_logprobs fwd": 10.0,
    "token_logprobs fwd+entropy": 13.0,
    "token_logprobs bwd": 8.0,
    "token_logprobs bwd+entropy": 8.0,
}


@dataclasses.dataclass
class Variant:
    """One launch of one kernel: ``run`` calls a launcher on meta tensors.  The op modules'
    ``static_variants()`` return these fields as dicts (ppo_fast does not import bench)."""

    name: str  # e.g. "token_logprobs fwd bf16 V=151936"
    budget_key: str | None  # a key of BUDGETS, or None
    bytes_per_element: int | None  # global memory bytes per element (read + written); None: not modelled
    run: Callable[[], object]
    vector_loads_expected: bool = False  # 128-bit loads required (bf16, V % 8 == 0)
    # The constexpr holding the elements a loop iteration handles; None: no per-element
    # figure (a tiled matmul's loop is over its reduction dim, not over elements).
    block: str | None = "BLOCK"
    kernel: str | None = None  # the kernel whose launch is the variant's, where ``run`` launches several


@dataclasses.dataclass
class KernelReport:
    name: str
    kernel: str
    registers: int
    spill_bytes: int  # spill stores + loads, bytes (ptxas -v)
    shared_bytes: int
    ldg128: int  # 128-bit global loads in the hot loop (the whole kernel without a loop)
    ldg: int  # all global loads there
    stg128: int
    stg: int
    loop_instructions: int | None  # None: no loop
    elements_per_thread: float | None
    instructions_per_element: float | None
    bytes_per_element: int | None = None
    budget: float | None = None
    vector_loads_expected: bool = False
    signature: str = ""
    addressing: list[str] = dataclasses.field(default_factory=list)  # int32 address arithmetic found in the TTIR

    @property
    def issue_limit_gbps(self) -> float | None:
        if not self.instructions_per_element or not self.bytes_per_element:
            return None
        return self.bytes_per_element * ISSUE_RATE / self.instructions_per_element / 1e9

    def problems(self) -> list[str]:
        """What breaks a budget (empty when none does)."""
        out = []
        if self.spill_bytes:
            out.append(f"{self.spill_bytes} bytes spilled")
        if self.budget is not None and (
            self.instructions_per_element is None or self.instructions_per_element > self.budget
        ):
            out.append(f"{self.instructions_per_element} instructions per element > budget {self.budget}")
        if self.vector_loads_expected and (self.ldg128 == 0 or self.ldg128 != self.ldg):
            out.append(f"hot-loop global loads not all 128-bit ({self.ldg128} of {self.ldg})")
        return out + self.addressing


def int64_problems(ttir: str, int_args: list[str]) -> list[str]:
    """A Python int that fits reaches a kernel as ``i32``, so ``t * stride`` in int32 wraps once
    ``T * stride`` passes 2**31: every ``tt.addptr`` offset must be i64, and no i32 multiply may
    take an int argument of the kernel."""
    found = []
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        if "tt.addptr" in code:
            offset_type = code.rsplit(",", 1)[-1].strip()
            if not (offset_type == "i64" or offset_type.endswith("xi64>")):
                found.append(f"32-bit address offset: {code.strip()}")
        if "arith.muli" in code and re.search(r":\s*(i32|tensor<[0-9x]*xi32>)\s*$", code):
            operands = re.findall(r"%([A-Za-z_][A-Za-z0-9_]*)\b", code.split("=", 1)[1])
            if set(operands) & set(int_args):
                found.append(f"int32 product of an argument: {code.strip()}")
    return found


def write_json(path: pathlib.Path, reports: list[KernelReport]) -> None:
    """Every number of ``reports``, and each one's problems (``--json``; read back by ``read_json``)."""
    path.write_text(json.dumps([dataclasses.asdict(r) | {"problems": r.problems()} for r in reports], indent=1))


def read_json(path: pathlib.Path) -> list[KernelReport]:
    fields = {f.name for f in dataclasses.fields(KernelReport)}
    return [KernelReport(**{k: v for k, v in r.items() if k in fields}) for r in json.loads(path.read_text())]


# --------------------------------------------------------------------------- SASS analysis

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(\.L_x_\d+)")


def sass_functions(sass: str) -> dict[str, list[tuple[str | None, str]]]:
    """``{function: [(label or None, instruction)]}`` from nvdisasm output; a label is attached
    to the instruction it precedes."""
    functions: dict[str, list[tuple[str | None, str]]] = {}
    current = None
    pending_label = None
    for line in sass.splitlines():
        header = re.match(r"^\s*\.text\.(\S+):", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        label = _LABEL.match(line)
        if label:
            pending_label = label.group(1)
            continue
        ins = _INSTRUCTION.match(line)
        if ins and current is not None:
            text = ins.group(1)
            if not re.match(r"^NOP\b", text):
                current.append((pending_label, text))
            pending_label = None
    return functions


def hot_loop(instructions: list[tuple[str | None, str]]) -> list[str] | None:
    """The instructions of the widest loop (a branch back to a label before it), or None."""
    where = {label: i for i, (label, _) in enumerate(instructions) if label}
    best = None
    for i, (_, text) in enumerate(instructions):
        branch = _BRANCH_TARGET.search(text)
        if branch and branch.group(1) in where and where[branch.group(1)] < i:
            start = where[branch.group(1)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    return None if best is None else [text for _, text in instructions[best[0] : best[1] + 1]]


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def count_memory(instructions: list[str]) -> dict[str, int]:
    ops = [_opcode(t) for t in instructions]
    return {
        "ldg": sum(op.startswith("LDG") for op in ops),
        "ldg128": sum(op.startswith("LDG") and op.endswith(".128") for op in ops),
        "stg": sum(op.startswith("STG") for op in ops),
        "stg128": sum(op.startswith("STG") and op.endswith(".128") for op in ops),
    }


def _nvidia_tool(name: str) -> str:
    import triton

    path = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            # -ndf: no dataflow analysis (a quarter of the time; the listing is the same)
            [_nvidia_tool("nvdisasm"), "-c", "-ndf", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout


_PTXAS_FUNCTION = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """``{function: {registers, spill_bytes, shared_bytes}}`` from ``ptxas -v`` output."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _PTXAS_FUNCTION.search(line):
            current = out.setdefault(m.group(1), {"registers": 0, "spill_bytes": 0, "shared_bytes": 0})
        elif current is not None:
            if m := _PTXAS_SPILLS.search(line):
                current["spill_bytes"] = int(m.group(1)) + int(m.group(2))
            if m := _PTXAS_REGS.search(line):
                current["registers"] = int(m.group(1))
            if m := _PTXAS_SMEM.search(line):
                current["shared_bytes"] = int(m.group(1))
    return out


def analyse(name, kernel, instructions, resources, elements_per_thread, **extra) -> KernelReport:
    loop = hot_loop(instructions)
    body = loop if loop is not None else [text for _, text in instructions]
    per_element = round(len(body) / elements_per_thread, 2) if elements_per_thread else None
    return KernelReport(
        name=name,
        kernel=kernel,
        loop_instructions=None if loop is None else len(loop),
        elements_per_thread=elements_per_thread,
        instructions_per_element=per_element,
        **resources,
        **count_memory(body),
        **extra,
    )


# --------------------------------------------------------------------------- Triton


def triton_op_modules() -> tuple:
    """The Triton backend's op modules (``ppo_fast.backends.triton.<op>``), in the backend's order."""
    from ppo_fast.backends import triton as backend

    try:  # imported here also where no kernel can run (no GPU, no interpreter): only compiled
        return backend.MODULES or backend.load_modules()
    except ImportError as err:
        raise RuntimeError(f"the Triton backend cannot be used: {err}") from None


def triton_variants() -> list[Variant]:
    """Every Triton kernel variant the launchers use, at the target shapes: each op module's
    ``static_variants()`` (dicts of :class:`Variant`'s fields), next to its kernels."""
    return [Variant(**variant) for module in triton_op_modules() for variant in module.static_variants()]


@dataclasses.dataclass
class Launch:
    """What a real launch would compile: Triton's binder output for the intercepted call."""

    fn: object  # the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: object


@contextlib.contextmanager
def intercept_launches(target):
    """Within the block, ``kernel[grid](...)`` compiles nothing and launches nothing: it
    records the :class:`Launch` that Triton's own binder makes of the arguments for ``target``."""
    from triton.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(target)
    launches: list[Launch] = []

    def run(self, *args, grid, warmup, **kwargs):
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        launches.append(Launch(self, signature, constexprs, attrs, options))

    original = jit.JITFunction.run
    jit.JITFunction.run = run
    try:
        yield launches
    finally:
        jit.JITFunction.run = original


def capture(variant: Variant, target) -> Launch:
    """The variant's (first) launch; a launcher that loops over chunks launches the same kernel again
    (``variant.kernel``'s, where it launches other kernels too)."""
    with intercept_launches(target) as launches:
        variant.run()
    if variant.kernel is not None:
        launches = [launch for launch in launches if launch.fn.__name__ == variant.kernel]
    if not launches or len({launch.fn for launch in launches}) != 1:
        raise RuntimeError(f"{variant.name}: expected launches of one kernel, got {[launch.fn for launch in launches]}")
    return launches[0]


def compile_launch(launch: Launch, target):
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(fn=launch.fn, signature=launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
    return triton.compile(src, target=target, options=launch.options.__dict__)


def _signature_text(launch: Launch) -> str:
    """The specialisation in one line: typed args with their hints, constexpr values."""
    names = list(launch.signature)
    parts = []
    for i, name in enumerate(names):
        kind = launch.signature[name]
        if kind == "constexpr":
            value = launch.constexprs.get((i,))
            parts.append(f"{name}={getattr(value, 'name', value)}")
        else:
            hints = [f"{k.split('.')[-1]}={v}" for k, v in (launch.attrs.get((i,)) or [])]
            parts.append(f"{name}:{kind}" + (f"[{','.join(hints)}]" if hints else ""))
    return ", ".join(parts)


def _ptxas(arch: str) -> str:
    """The ptxas Triton itself assembles ``arch`` with: its PTX version follows that ptxas (Triton
    3.9 takes its newer ``ptxas-blackwell`` from sm_90 on, whose PTX the older one refuses)."""
    from triton.backends.nvidia import compiler

    if not hasattr(compiler, "get_ptxas"):  # an older Triton: one bundled ptxas
        return _nvidia_tool("ptxas")
    return compiler.get_ptxas(int(re.match(r"sm_(\d+)", arch).group(1))).path


def _ptxas_resources(ptx: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
        ptxas = subprocess.run(
            [_ptxas(arch), "-v", f"--gpu-name={arch}", str(src), "-o", str(src.with_suffix(".cubin"))],
            capture_output=True,
            text=True,
        )
        if ptxas.returncode:  # ptxas says why on stderr, which CalledProcessError would not show
            raise RuntimeError(f"{' '.join(ptxas.args)}: exit {ptxas.returncode}\n{ptxas.stderr}")
    (resources,) = parse_ptxas_log(ptxas.stderr).values()
    return resources


def triton_kernels() -> list[str]:
    """The names of every ``@triton.jit`` kernel (``*_kernel``) in the Triton backend's modules, its op
    modules and the private ones they share (``_gemm_head``, ``_policy_terms``...): the variants must
    launch each at least once."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface  # a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction

    from ppo_fast.backends import triton as backend

    triton_op_modules()  # the backend can be used (else: why not)
    names = set()
    for info in pkgutil.iter_modules(backend.__path__):
        module = importlib.import_module(f"{backend.__name__}.{info.name}")
        names |= {
            name for name, obj in vars(module).items() if isinstance(obj, KernelInterface) and name.endswith("_kernel")
        }
    return sorted(names)


def analyse_triton(variants: list[Variant] | None = None) -> list[KernelReport]:
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, WARP)  # what the driver reports for an H100/H200
    reports = []
    for variant in variants if variants is not None else triton_variants():
        launch = capture(variant, target)
        compiled = compile_launch(launch, target)
        (instructions,) = sass_functions(disassemble(compiled.asm["cubin"])).values()
        names = list(launch.signature)
        block = (
            None
            if variant.block is None
            else next(v for (i,), v in launch.constexprs.items() if names[i].startswith(variant.block))
        )
        resources = _ptxas_resources(compiled.asm["ptx"])
        resources["shared_bytes"] += compiled.metadata.shared  # Triton's dynamic shared memory
        per_thread = None if block is None else block / (WARP * launch.options.num_warps)
        report = analyse(
            variant.name,
            launch.fn.fn.__name__,
            instructions,
            resources,
            per_thread,
            bytes_per_element=variant.bytes_per_element,
            budget=BUDGETS.get(variant.budget_key),
            vector_loads_expected=variant.vector_loads_expected,
            signature=_signature_text(launch),
            addressing=int64_problems(
                compiled.asm["ttir"], [n for n, k in launch.signature.items() if k in ("i32", "i64")]
            ),
        )
        reports.append(report)
    return reports


def sampled(variants: list[Variant]) -> list[Variant]:
    """The tests' fast tier (``--sample``): the first variant of each kernel for each set of pointer dtypes,
    instruction budget and 128-bit-load expectation; the rest differ in constexprs and shapes (the full tier's)."""
    from triton.backends.compiler import GPUTarget

    target, seen, out = GPUTarget("cuda", 90, WARP), set(), []
    for variant in variants:
        launch = capture(variant, target)
        key = (_pointer_dtypes(launch), variant.budget_key, variant.vector_loads_expected)
        if key not in seen:
            seen.add(key)
            out.append(variant)
    return out


def _pointer_dtypes(launch: Launch) -> tuple:
    return launch.fn.fn.__name__, frozenset(t for t in launch.signature.values() if t.startswith("*"))


def compile_for(capability: int, sample: bool = False, variants: list[Variant] | None = None) -> tuple[int, list[str]]:
    """Every variant (of ``variants``, default all) compiled for a compute capability (100: B200/GB200), with
    no budget (those are sm_90's), or with ``sample`` every variant of the kernels with ``tl.dot`` (where an
    architecture's tensor-core paths differ) and the first of each other kernel and set of pointer dtypes:
    ``(variants compiled, the failures as "variant on sm_XY: error")``."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability, WARP)
    failures, seen, tried = [], set(), 0
    for variant in triton_variants() if variants is None else variants:
        try:
            launch = capture(variant, target)
            key = _pointer_dtypes(launch)
            if "tl.dot(" in inspect.getsource(sys.modules[launch.fn.fn.__module__]):  # tensor-core paths (tf32...)
                key = variant.name
            if sample and key in seen:
                continue
            seen.add(key)
        except Exception:  # noqa: BLE001 (a launch that cannot be captured is tried, and fails, below)
            launch = None
        tried += 1
        try:
            if launch is None:
                launch = capture(variant, target)  # raises again, with its error
            if not compile_launch(launch, target).asm.get("cubin"):
                raise RuntimeError("no cubin")
        except Exception as err:  # noqa: BLE001 (each failure is reported, the rest still compile)
            failures.append(f"{variant.name} on sm_{capability}: {type(err).__name__}: {str(err)[:300]}")
    return tried, failures


# --------------------------------------------------------------------------- CUDA


def _demangled(names: list[str]) -> dict[str, str]:
    """Readable kernel names (the mangled ones where no demangler is installed)."""
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if filt is None:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True).stdout.splitlines()
    short = [
        re.sub(r"\(.*\)$", "", re.sub(r"ppo_fast::cuda::(\(anonymous namespace\)|_GLOBAL__N__\w+)::", "", n))
        for n in out
    ]
    short = [re.sub(r"ppo_fast::cuda::|\(anonymous namespace\)::", "", n).replace("void ", "") for n in short]
    return dict(zip(names, short))


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    candidates = [pathlib.Path(home) / "bin" / "nvcc"] if home else []
    candidates += [pathlib.Path(p) for p in sorted(pathlib.Path("/usr/local").glob("cuda*/bin/nvcc"))]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nvcc")
    if not found:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME)")
    return found


def analyse_cuda(sources: list[pathlib.Path] | None = None) -> list[KernelReport]:
    """Every ``__global__`` function of ``csrc/cuda/*.cu``: ``nvcc -Xptxas -v`` for sm_90, its SASS.

    The CUDA kernels have no single block constant to divide by: their hot loop is
    reported in instructions (per element only where a loop exists and one thread handles
    one element per iteration is not assumed)."""
    reports = []
    for source in sources or sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        with tempfile.TemporaryDirectory() as tmp:
            cubin = pathlib.Path(tmp) / "k.cubin"
            cmd = [
                _nvcc(),
                "-cubin",
                "-arch=sm_90",
                "-O3",
                "-std=c++17",
                "-Xptxas",
                "-v",
                "-I",
                str(ROOT / "csrc"),
                "-o",
                str(cubin),
                str(source),
            ]
            log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
            sass = disassemble(cubin.read_bytes())
        resources = parse_ptxas_log(log)
        functions = sass_functions(sass)
        names = _demangled(list(functions))
        for mangled, instructions in functions.items():
            reports.append(
                analyse(f"{source.name}: {names[mangled]}", names[mangled], instructions, resources[mangled], None)
            )
    return reports


# --------------------------------------------------------------------------- output


def _fmt(x, digits=1):
    return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def markdown(reports: list[KernelReport]) -> str:
    lines = [
        "| kernel variant | regs | spills B | smem B | 128-bit loads / all (loop) | 128-bit stores / all (loop) | loop instr | elem/thread/iter | instr/elem | budget | issue limit GB/s (x 4.8 TB/s) | bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        limit = r.issue_limit_gbps
        limit_text = "-" if limit is None else f"{limit:,.0f} ({limit * 1e9 / HBM_PEAK:.2f}x)"
        bound = "-" if limit is None else ("memory" if limit * 1e9 >= HBM_PEAK else "issue")
        budget = "-" if r.budget is None else (f"<= {r.budget:g} " + ("ok" if not r.problems() else "MISSED"))
        if r.budget is None and r.problems():
            budget = "MISSED"
        lines.append(
            f"| {r.name} | {r.registers} | {r.spill_bytes} | {r.shared_bytes} | {r.ldg128}/{r.ldg} | {r.stg128}/{r.stg} | "
            f"{_fmt(r.loop_instructions)} | {_fmt(r.elements_per_thread, 0)} | {_fmt(r.instructions_per_element, 2)} | {budget} | {limit_text} | {bound} |"
        )
    return "\n".join(lines)


def threshold_passes() -> str:
    """How many times the Triton truncation thresholds read a row, worst case (by the key's bits)."""
    import torch

    from ppo_fast._sampling import Truncation
    from ppo_fast.backends.triton._truncation import passes

    cases = {"top_k": Truncation(top_k=50), "top_p": Truncation(top_p=0.9), "top_k + top_p": Truncation(50, 0.9)}
    lines = [
        "| threshold passes per row (worst case; a bisection: one per key bit) | bf16 logits | fp32 (the fused head's u, with its midpoint pass) |",
        "|---|---|---|",
    ]
    for name, t in cases.items():
        lines.append(f"| {name} | {passes(t, torch.bfloat16)} | {passes(t, torch.float32, midpoint=True)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench static", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="also write every number here")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels (no nvcc needed)")
    parser.add_argument("--only", help="only the Triton variants whose name contains this")
    parser.add_argument(
        "--triton-report",
        type=pathlib.Path,
        metavar="JSON",
        help="the Triton kernels' reports from this file (written by --json, e.g. by "
        "tests/backends/test_triton_compiles_for_gpu.py in the same CI run) instead of compiling them again; "
        "the variants it lacks (the tests' fast tier reports a sample) are compiled",
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="only the first variant of each kernel, set of pointer dtypes and budget (the tests' fast tier)",
    )
    parser.add_argument(
        "--also-for",
        default="",
        metavar="CC,...",
        help="also compile every Triton variant (with --sample, the sample) for these compute capabilities "
        "(e.g. 100), without budgets",
    )
    parser.add_argument(
        "--also-sample",
        action="store_true",
        help="--also-for compiles one variant of each kernel and set of pointer dtypes, every variant of the "
        "kernels with tl.dot (the compat cells' compile tests)",
    )
    args = parser.parse_args(argv)
    every = triton_variants()
    variants = [v for v in every if not args.only or args.only in v.name]
    if args.sample:
        variants = sampled(variants)
        print(f"sm_90: {len(variants)} of {len(every)} Triton variants sampled")
    for cc in filter(None, args.also_for.split(",")):
        tried, failed = compile_for(int(cc), sample=args.also_sample, variants=variants)
        print(f"sm_{cc}: {tried - len(failed)} of {tried} Triton variants tried compiled ({len(every)} in all)")
        for failure in failed:
            print("DOES NOT COMPILE:", failure, file=sys.stderr)
        if failed:
            return 1
    reported = read_json(args.triton_report) if args.triton_report else []
    wanted = {v.name for v in variants}
    reports = {r.name: r for r in reported if r.name in wanted}
    missing = [v for v in variants if v.name not in reports]
    if missing and os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: Triton cannot compile under the interpreter")
    if reported:
        print(f"{args.triton_report}: {len(reports)} of {len(variants)} Triton variants; {len(missing)} compiled now")
    reports |= {r.name: r for r in analyse_triton(missing)} if missing else {}
    reports = [reports[v.name] for v in variants]
    if not args.no_cuda and not args.only:
        reports += analyse_cuda()
    print(markdown(reports))
    print("\n" + threshold_passes())
    failures = [f"{r.name}: {p}" for r in reports for p in r.problems()]
    if args.json:
        write_json(args.json, reports)
    for failure in failures:
        print("BUDGET MISSED:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
