"""The KDA forward's Triton kernels as a GPU would get them, inspected on a machine without one.

  .venv/bin/python scripts/triton_offline.py dump --shape=2x256x16x128 --out=/tmp/ttir
  <python with triton==3.6.0> scripts/triton_offline.py compile /tmp/ttir/kda_intra_fwd_key_tiles.ttir

`dump` (this repo's .venv) exports the undifferentiated fused forward for CUDA (an H200 described to Pallas's
Triton lowering) and writes each Triton launch's IR as MLIR text, `<kernel>.ttir`, with its launch parameters in
`<kernel>.json`. `compile` (any Python with the GPU image's triton, e.g. a scratch venv) compiles one for sm_90a
and prints ptxas's registers, spills and shared memory and the PTX's memory and matrix instructions: counts to
compare variants before a device call (XLA's own Triton may allocate registers differently: ncu decides).
"""
import argparse
import collections
import json
import os
import pathlib
import re


def dump(shape, out):
  os.environ["K3JAX_PALLAS_INTERPRET"] = "0"
  import jax
  import jax.numpy as jnp
  from jax._src.lib import triton
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import pallas_call_registration as registration

  from k3jax.ops import kda
  registration.gpu_info_lib.get_gpu_info = lambda: registration.gpu_info_lib.GpuInfo(
      gpu_version=None, arch_name="9.0", compute_capability=90)
  B, T, H, D = (int(s) for s in shape.split("x"))
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = [bf(B, T, H, D)] * 4 + [bf(B, T, H), jax.ShapeDtypeStruct((H,), jnp.float32),
                                 jax.ShapeDtypeStruct((H, D), jnp.float32)]
  forward = lambda *a: kda.fused_kda(*a, lower_bound=-5.0, backend="pallas")[0]
  allow = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  text = jax.export.export(jax.jit(forward), platforms=["cuda"], disabled_checks=[allow])(*args).mlir_module()
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  context = ir.Context()
  triton.dialect.register_dialect(context)
  context.allow_unregistered_dialects = True   # gpu.barrier (jaxlib lacks the dialect; rewritten below)
  # Each launch's backend config holds its Triton module as escaped MLIR bytecode: ir = "ML\EFR...", then its name.
  for m in re.finditer(r'ir = "((?:[^"\\]|\\.)*)", name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+)',
                       text):
    code = re.sub(rb"\\([0-9A-Fa-f]{2})", lambda h: bytes([int(h.group(1), 16)]), m.group(1).encode())
    with context:
      context.load_all_available_dialects()
      module = str(ir.Module.parse(code))
    # Printed generically with a newer MLIR's properties, which Triton 3.6's parser rejects; its short form parses.
    module = re.sub(r'"gpu\.barrier"\(\) <[^>]*> : \(\) -> \(\)', "gpu.barrier", module)
    (out / f"{m.group(2)}.ttir").write_text(module)
    (out / f"{m.group(2)}.json").write_text(json.dumps(dict(num_stages=int(m.group(3)), num_warps=int(m.group(4)))))
    print(out / f"{m.group(2)}.ttir", "stages", m.group(3), "warps", m.group(4))


def compile_one(path, num_warps, num_stages):
  import subprocess

  import triton
  from triton.backends.compiler import GPUTarget
  launch = json.loads(pathlib.Path(path).with_suffix(".json").read_text())
  options = dict(num_warps=num_warps or launch["num_warps"], num_stages=num_stages or launch["num_stages"])
  kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options=options)
  ptx = pathlib.Path(path).with_suffix(".ptx")
  ptx.write_text(kernel.asm["ptx"])
  ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
  done = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                        capture_output=True, text=True, check=True)
  print(options, "shared bytes", kernel.metadata.shared)
  print("\n".join(line.strip() for line in done.stderr.splitlines() if "Used" in line or "spill" in line))
  ops = collections.Counter(re.findall(r"^\s*(?:@%p\d+ )?([a-z]+(?:\.[a-z0-9]+)*)", kernel.asm["ptx"], re.M))
  kinds = ("ld.", "st.", "ldmatrix", "mma", "cp.async", "bar")
  print({op: n for op, n in sorted(ops.items()) if op.startswith(kinds)})


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  d = sub.add_parser("dump")
  d.add_argument("--shape", default="2x256x16x128", help="BxTxHxD")
  d.add_argument("--out", required=True)
  c = sub.add_parser("compile")
  c.add_argument("path")
  c.add_argument("--num_warps", type=int, default=None, help="default: the launch's")
  c.add_argument("--num_stages", type=int, default=None, help="default: the launch's")
  a = parser.parse_args()
  if a.command == "dump":
    dump(a.shape, a.out)
  else:
    compile_one(a.path, a.num_warps, a.num_stages)


if __name__ == "__main__":
  main()
