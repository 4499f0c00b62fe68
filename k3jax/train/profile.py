"""Where a compiled program's device time goes: its kernels traced by the JAX profiler, grouped by kind.

Kinds (first rule that matches a kernel's name, its HLO instruction's custom-call target or its op_name scope):
  kda           the KDA Pallas kernels (`kda_*`)
  grouped_gemm  the MoE grouped GEMMs (Mosaic kernels under the `grouped_gemm` scope, `*ragged_dot*`)
  attention     cuDNN / flash attention, the MLA decode kernel (mla_decode_*)
  gemm          cuBLAS / cutlass / XLA-Triton matrix products (on a CPU: dot and YNNPACK fusions)
  collective    NCCL and XLA collectives
  dispatch      sorts, scatters and gathers (MoE dispatch under the `moe_dispatch` scope, embedding, top-k)
  other         every other fusion, copy and memset: elementwise and reduction glue
Glue is everything but gemm, grouped_gemm, attention and kda; it is also split by named scope, found in a kernel's
op_name: the layers' parts (SCOPES, the outermost that matches), else the step's own (STEP_SCOPES: embedding,
head, loss, optimizer, ...; the scanned layers' and the layer calls' own bookkeeping), else, for our glue kernels
whose trace names no op, their layer's (KERNEL_SCOPES), else "unscoped". XLA's own instructions (copies, fusions
it names nothing, zeros for a loop's outputs) take the op_name of what they run, move or feed (`hlo_instructions`),
and a kernel that several ops launch (a memcpy, a cuBLAS GEMM) is counted per op. On a GPU the times are
the device streams' kernel events; on a CPU they are XLA:CPU's thunks (they overlap on its thread pool: proportions,
not a timeline). Each kernel's bytes are its HLO instruction's operands and results, each counted once and whole
(an upper bound where a fusion reads a slice of an operand): glue is elementwise and reduction passes, so its GB
over its ms (TB/s) says whether it runs at the memory's bandwidth, and its GB is what a cut has to remove.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import math
import os
import re
import tempfile
import warnings
from typing import Callable, NamedTuple

import jax

from k3jax.ops.moe_dispatch import SCOPE as DISPATCH_SCOPE
from pallas_kernels.grouped_gemm.ops import SCOPE as GROUPED_GEMM_SCOPE

KINDS = ("gemm", "grouped_gemm", "attention", "kda", "dispatch", "collective", "other")
COMPUTE = ("gemm", "grouped_gemm", "attention", "kda")  # the rest is glue
SCOPES = ("moe", "kda", "mla", "ffn", "attnres", "balancer")  # the layers' named scopes
# The step's parts outside the layers, by name and the op_name that marks them (the first that matches): the model's
# and train step's scopes, then the layer scan's loop (stacked weights sliced, gradients stacked) and the layer calls'
# boundaries (the cotangents a layer's jit returns), which no scope inside a layer holds.
STEP_SCOPES = (("embed", r"\bembed\b"), ("head", r"\bhead\b"), ("loss", r"\bloss\b"),
               ("optimizer", r"\boptimizer\b"), ("accumulate", r"\baccumulate\b"), ("metrics", r"\bmetrics\b"),
               ("layer_call", r"jit\(_layer_forward\)"), ("layer_scan", r"\bgroups\b"))
# Our glue kernels, whose trace events name no HLO op (a `traced_once` call's kernel): their layer's scope by name.
KERNEL_SCOPES = (("kda", r"^short_conv"),)
_GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|gemv|cublas|matmul|onednn|^dot\b|^ynn_fusion", re.IGNORECASE)
_COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|all[-_]?to[-_]?all|reduce[-_]?scatter|"
                         r"collective[-_]?permute", re.IGNORECASE)
_DISPATCH = re.compile(r"sort|scatter|gather|radix|top_?k", re.IGNORECASE)
_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^=]*?)\b([\w\-]+)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SHARED_KERNEL = re.compile(r'deduplicated_name="([^"]*)"')
_PASS_ON = ("get-tuple-element", "tuple", "bitcast", "copy")   # ops that pass a value on unchanged
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_OPERAND = re.compile(r"(?:([a-z]+[0-9a-z]*\[[\d,]*\])(?:\{[^}]*\})?\s+)?%([\w.\-]+)")   # (type beside it, name)
# Bytes per element of HLO's array types (others, such as token[] and the 4-bit types, count 0 or their fraction).
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}


class Instruction(NamedTuple):
  """What a kernel's HLO instruction says of it: its custom-call target or opcode, the op_name it is counted under
  (`hlo_instructions`), the bytes of its operands and results, and the kernel it launches: XLA compiles alike
  fusions once and names that kernel after one of them (`deduplicated_name`); "" where the instruction names none."""
  target: str = ""
  op_name: str = ""
  bytes: float = 0.0
  kernel: str = ""


def _array_bytes(type_text: str) -> float:
  """Bytes of the arrays an HLO type names (a tuple's elements summed); f8 types count 1 a value."""
  total = 0.0
  for element, dims in _ARRAY.findall(type_text):
    size = _ELEMENT_BYTES.get(element, 1 if element.startswith("f8") else 0)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str            # the kernel (GPU) or thunk (CPU)
  kind: str
  launches: float      # per call
  ms: float            # per call
  op_name: str = ""    # the JAX op_name of its HLO instruction, when the trace names one
  gb: float = 0.0      # per call: the bytes its instructions read and write (`Instruction.bytes`), in GB

  @property
  def tb_per_s(self) -> float | None:
    """Its bytes over its time (GB per ms), None without either."""
    return self.gb / self.ms if self.gb and self.ms else None

  @property
  def scope(self) -> str:
    """The outermost of SCOPES in the op_name, else the first of STEP_SCOPES that matches, else the layer of one of
    our kernels by its name (KERNEL_SCOPES), else "unscoped"."""
    found = [(m.start(), s) for s in SCOPES for m in [re.search(rf"\b{s}\b", self.op_name)] if m]
    if found:
      return min(found)[1]
    step = next((name for name, pattern in STEP_SCOPES if re.search(pattern, self.op_name)), None)
    return step or next((name for name, pattern in KERNEL_SCOPES if re.search(pattern, self.name)), "unscoped")


def kernel_kind(name: str, target: str = "", op_name: str = "") -> str:
  """The kind (one of KINDS) of a kernel from its name, its HLO instruction's custom-call target and op_name."""
  in_scope = lambda scope: re.search(rf"\b{scope}\b", op_name) is not None
  if name.startswith("kda_"):
    return "kda"
  mosaic = target.startswith("mosaic_gpu") or "mosaic_gpu" in name
  # Without an op_name (a trace that names no HLO op), the model's only other Mosaic kernels are KDA's, named above.
  if "ragged_dot" in name or (mosaic and (in_scope(GROUPED_GEMM_SCOPE) or not op_name)):
    return "grouped_gemm"
  if re.search(r"cudnn|fmha|flash|sdpa|mla_decode", f"{name} {target}", re.IGNORECASE):
    return "attention"
  if _GEMM.search(name) or "cublas" in target:
    return "gemm"
  if _COLLECTIVE.search(name) or _COLLECTIVE.search(target):
    return "collective"
  if _DISPATCH.search(name) or in_scope(DISPATCH_SCOPE):
    return "dispatch"
  return "other"


def hlo_instructions(hlo_text: str) -> dict[str, Instruction]:
  """Instruction name, and its GPU kernel's name (the same with '.' and '-' made '_'), -> `Instruction` (custom-call
  target or opcode, op_name, bytes of operands and results), from a compiled program's HLO text. An operand's bytes
  are those of the instruction that defines it, else of the type written beside it.

  XLA writes some instructions without an op_name of their own. Each then takes the op_name of what it runs, moves
  or feeds, in this order: for a fusion, its fused root's (else its last fused instruction's that has one: the
  kernel runs those ops); then its first operand's that has one, found the same way (a copy of a value belongs to
  the value's producer); then its first user's, looking through tuples that pass it on (zeros XLA writes for a
  loop's stacked outputs belong to that loop). What none of these names stays without one ("unscoped")."""
  lines = {}                      # name -> (opcode or target, own op_name, operand names, called computation)
  result_bytes, typed_operands = {}, {}   # name -> its result's bytes; name -> [(bytes written beside, operand)]
  kernels = {}                            # name -> the shared kernel's `deduplicated_name`, or ""
  inner = collections.defaultdict(list)   # computation -> its instructions in order
  roots = {}                              # computation -> its root instruction
  users = collections.defaultdict(list)
  computation = None
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)   # XLA's /*index=5*/ in long tuples
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    m = _HLO_LINE.match(line)
    if not m:
      continue
    name = m.group(1)
    target, op_name, calls = _TARGET.search(line), _OP_NAME.search(line), _CALLS.search(line)
    typed = [(_array_bytes(t), o) for t, o in _OPERAND.findall(line[m.end():].split(")", 1)[0])]
    operands = [o for _, o in typed]
    lines[name] = (target.group(1) if target else m.group(3), op_name.group(1) if op_name else "", operands,
                   calls.group(1) if calls else None)
    shared = _SHARED_KERNEL.search(line)
    kernels[name] = shared.group(1) if shared else ""
    result_bytes[name] = _array_bytes(m.group(2))
    typed_operands[name] = typed
    for operand in operands:
      users[operand].append(name)
    if computation is not None:
      inner[computation].append(name)
      if line.lstrip().startswith("ROOT "):
        roots[computation] = name

  def own(name: str) -> str:
    """The op_name the instruction carries, else, for a fusion, its fused root's (a multi-output root's first
    element's with one), else its last fused instruction's that has one."""
    _, op_name, _, called = lines[name]
    if op_name or called not in inner:
      return op_name
    root = roots.get(called)
    return (root and produced(root)) or next((lines[i][1] for i in reversed(inner[called]) if lines[i][1]), "")

  @functools.cache
  def produced(name: str, depth: int = 0) -> str:
    """`own`, else the first operand's `produced` (a tuple's, its first element's with one)."""
    if name not in lines:
      return ""
    found = own(name)
    for operand in lines[name][2] if not found and depth < 12 else ():
      found = produced(operand, depth + 1)
      if found:
        break
    return found

  def used(name: str) -> str:
    """The `own` op_name of the first user that has one, looking through users that only pass a value on (a tuple
    and its elements: a loop's initial state)."""
    seen, frontier = {name}, [name]
    for _ in range(6):
      passed = []
      for user in (u for n in frontier for u in users[n] if u not in seen):
        seen.add(user)
        found = own(user)
        if found:
          return found
        if lines[user][0] in _PASS_ON:
          passed.append(user)
      frontier = passed
    return ""

  out = {}
  for name, (opcode, *_rest) in lines.items():
    moved = result_bytes[name] + sum(result_bytes.get(o, written) for written, o in typed_operands[name])
    found = Instruction(opcode, produced(name) or used(name), moved, kernels[name])
    out[name] = found
    out.setdefault(re.sub(r"[.\-]", "_", name), found)
  return out


def _profiled(fn: Callable[[], object], options=None):
  """(fn(), the JAX profiler's trace of it as a `jax.profiler.ProfileData`), `options` its ProfileOptions."""
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, profiler_options=options):
      out = fn()
    path, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    with open(path, "rb") as f:
      return out, ProfileData.from_serialized_xspace(f.read())


def trace_kernels(run: Callable[[], object], *, calls: int, hlo_text: str = "") -> list[Kernel]:
  """Runs `run()` (which makes `calls` calls of a compiled program and returns their outputs) under the profiler,
  and returns the program's kernels per call, slowest first (`kernels_of`). `hlo_text` (the compiled program's
  `as_text()`) names their instructions' custom-call targets and op_names; without it, kinds come from kernel names
  alone."""
  _, traced = _profiled(lambda: jax.block_until_ready(run()))
  module = re.match(r"HloModule ([^\s,]+)", hlo_text)
  return kernels_of(_kernel_events(traced, module and module.group(1)), hlo_instructions(hlo_text), calls=calls)


def kernels_of(events, instructions: dict[str, Instruction], *, calls: int) -> list[Kernel]:
  """(kernel name, HLO instruction, duration ns) events of `calls` calls -> their kernels per call, slowest first,
  one per kernel name and HLO op (`instructions`, as `hlo_instructions` gives): a kernel that several ops launch
  (a copy, a cuBLAS GEMM) counts in each op's scope; its bytes are summed over its launches' instructions. An event
  whose instruction is not found takes the op of an instruction of the kernel's own name, if any.

  A kernel that XLA compiled once for several alike fusions (`Instruction.kernel`) whose every launch names the
  same one of them (the trace names the instruction the kernel is named after) is shared evenly among them all:
  alike fusions run the same code on the same shapes, so each launch costs the same wherever it belongs."""
  sharing = collections.defaultdict(list)   # shared kernel -> its instructions
  for found in {id(i): i for i in instructions.values()}.values():   # once each, not once per name they go by
    if found.kernel:
      sharing[found.kernel].append(found)
  resolved = [(name, instructions.get(hlo_op) or instructions.get(name, Instruction()), duration_ns)
              for name, hlo_op, duration_ns in events]
  seen = collections.defaultdict(set)
  for name, found, _ in resolved:
    seen[name].add(id(found))
  launches, ns, moved = collections.Counter(), collections.Counter(), collections.Counter()
  for name, found, duration_ns in resolved:
    among = sharing[found.kernel] if found.kernel and len(seen[name]) == 1 else [found]
    for member in among:
      key = (name, member.target, member.op_name)
      launches[key] += 1 / len(among)
      ns[key] += duration_ns / len(among)
      moved[key] += member.bytes / len(among)
  kernels = []
  for key, duration_ns in ns.items():
    name, target, op_name = key
    kernels.append(Kernel(name, kernel_kind(name, target, op_name), launches[key] / calls, duration_ns / calls / 1e6,
                          op_name, moved[key] / calls / 1e9))
  return sorted(kernels, key=lambda k: -k.ms)


def trace_compile(compile_fn: Callable[[], object], *, top: int = 25):
  """Runs `compile_fn()` (an XLA compile) under the profiler, Python's tracer off, and returns (its result, the
  `top` host-side phases by seconds): each named event of XLA's compiler (pass pipelines, autotuning, kernel
  compiles, PTX to cubin), {"name", "s", "count"}, seconds summed over every call and thread (the thread pool's
  phases add up to more than the wall time)."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  out, traced = _profiled(compile_fn, options)
  seconds, counts = collections.Counter(), collections.Counter()
  for plane in traced.planes:
    if plane.name.startswith("/host:CPU"):
      for line in plane.lines:
        for event in line.events:
          seconds[event.name] += event.duration_ns / 1e9
          counts[event.name] += 1
  return out, [{"name": name, "s": s, "count": counts[name]} for name, s in seconds.most_common(top)]


def format_compile_phases(phases: list[dict]) -> str:
  return "\n".join(f"  {p['s']:>8.1f} s x{p['count']:<6} {p['name'][:90]}" for p in phases)


def _kernel_events(profile, module: str | None):
  """(name, HLO instruction, duration ns) of each kernel of `module` (any when None; events that name no module are
  kept): the GPU planes' stream lines (their derived "XLA Ops" line repeats the same time), else XLA:CPU's thunks
  (host events that name an HLO op)."""
  gpu = [p for p in profile.planes if p.name.startswith("/device:GPU")]
  for plane in gpu or [p for p in profile.planes if p.name.startswith("/host:CPU")]:
    for line in plane.lines:
      if gpu and not line.name.startswith("Stream #"):
        continue
      for event in line.events:
        with warnings.catch_warnings():  # the stats' C type warns of a missing __module__ when iterated
          warnings.simplefilter("ignore", DeprecationWarning)
          stats = dict(event.stats)
        if (gpu or "hlo_op" in stats) and stats.get("hlo_module", module) in (module, None):
          yield event.name, stats.get("hlo_op", ""), event.duration_ns


def breakdown(kernels: list[Kernel]) -> dict:
  """Per kind: ms, launches and GB per call; the total, the glue's share, its ms and GB by scope, and its GB and
  TB/s in all (None without bytes)."""
  kinds = {kind: {"ms": 0.0, "launches": 0.0, "gb": 0.0} for kind in KINDS}
  for k in kernels:
    kinds[k.kind]["ms"] += k.ms
    kinds[k.kind]["launches"] += k.launches
    kinds[k.kind]["gb"] += k.gb
  glue_by_scope, gb_by_scope = collections.Counter(), collections.Counter()
  for k in kernels:
    if k.kind not in COMPUTE:
      glue_by_scope[k.scope] += k.ms
      gb_by_scope[k.scope] += k.gb
  total = sum(v["ms"] for v in kinds.values())
  glue = sum(glue_by_scope.values())
  glue_gb = sum(gb_by_scope.values())
  return {"kinds": kinds, "total_ms": total, "launches": sum(v["launches"] for v in kinds.values()),
          "glue_share": glue / total if total else None, "glue_by_scope": dict(glue_by_scope.most_common()),
          "glue_gb": glue_gb, "glue_tb_per_s": glue_gb / glue if glue_gb and glue else None,
          "glue_gb_by_scope": {scope: gb_by_scope[scope] for scope in glue_by_scope}}


def format_breakdown(summary: dict, kernels: list[Kernel], *, top: int = 15) -> str:
  """The kinds table, then the `top` slowest kernels with their op_names."""
  total = summary["total_ms"] or float("nan")
  lines = [f"{'kind':<13} {'ms/step':>9} {'share':>6} {'launches':>9}"]
  for kind, v in summary["kinds"].items():
    lines.append(f"{kind:<13} {v['ms']:>9.2f} {v['ms'] / total:>6.1%} {v['launches']:>9.0f}")
  glue = "-" if summary["glue_share"] is None else f"{summary['glue_share']:.1%}"
  rate = summary.get("glue_tb_per_s")
  moved = f", {summary['glue_gb']:.1f} GB at {rate:.2f} TB/s" if rate else ""
  lines.append(f"{'total':<13} {summary['total_ms']:>9.2f} {'':>6} {summary['launches']:>9.0f}   glue {glue}{moved}")
  gb = summary.get("glue_gb_by_scope", {})
  lines.append("glue by scope: " + ", ".join(f"{s} {ms:.2f} ms" + (f" ({gb[s]:.1f} GB)" if gb.get(s) else "")
                                             for s, ms in summary["glue_by_scope"].items()))
  lines.append(f"slowest {top}:")
  for k in kernels[:top]:
    bandwidth = f"{k.gb:>7.3f} GB {k.tb_per_s:>5.2f} TB/s" if k.tb_per_s else f"{'':>21}"
    lines.append(f"  {k.ms:>8.3f} ms x{k.launches:<5g} {bandwidth} {k.kind:<12} {k.name[:60]}  {k.op_name[-70:]}")
  return "\n".join(lines)
