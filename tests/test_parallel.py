"""Expert parallelism on 8 simulated devices: the sharded layer equals the single-device one (fp32, ≤ 1e-5)."""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import parallel
from k3jax.layers.moe import expert_ffn
from pallas_kernels.grouped_gemm import Configs, GroupedGemmOptions, ops
from moe_testing import base, base_output_and_grads, forward, output_and_grads, rel, tokens, variant  # noqa: F401


def reference_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv):
  """The documented semantics of `jax.lax.ragged_all_to_all`, per device, in numpy."""
  n = len(operands)
  spd = len(send[0]) // n
  results = [o.copy() for o in outputs]
  for src in range(n):
    for i in range(len(send[src])):
      dst, j = divmod(i, spd)
      rows = operands[src][in_off[src][i]:in_off[src][i] + send[src][i]]
      assert recv[dst][src * spd + j] == len(rows)
      results[dst][out_off[src][i]:out_off[src][i] + len(rows)] = rows
  return results


def test_cpu_ragged_all_to_all_has_the_documented_semantics():
  n, spd, rows, out_rows = 4, 2, 12, 20
  rng = np.random.default_rng(0)
  send = rng.integers(0, 3, size=(n, n * spd))            # sizes from each source, per (dest, slot)
  in_off = np.cumsum(send, axis=1) - send                  # packed back to back (≤ 2·8 rows < 12)
  recv = np.stack([send[:, d * spd:(d + 1) * spd].reshape(-1) for d in range(n)])
  # receivers place (source, slot) slices back to back in reverse source order, leaving a gap of 1 row first
  out_off = np.zeros_like(send)
  for d in range(n):
    pos = 1
    for src in reversed(range(n)):
      for j in range(spd):
        out_off[src, d * spd + j] = pos
        pos += send[src, d * spd + j]
  operands = rng.normal(size=(n, rows, 3)).astype(np.float32)
  outputs = rng.normal(size=(n, out_rows, 3)).astype(np.float32)
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
  fn = jax.jit(jax.shard_map(
      lambda *a: parallel.ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None],
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  got = fn(operands, outputs, *(jnp.asarray(v, jnp.int32) for v in (in_off, send, out_off, recv)))
  expected = reference_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv)
  np.testing.assert_array_equal(np.asarray(got), np.stack(expected))


@pytest.mark.parametrize("mesh_spec", ["data:8,expert:1", "data:4,expert:2", "data:2,expert:4", "data:1,expert:8"])
def test_expert_parallel_layer_equals_single_device_outputs_and_gradients(base, mesh_spec):
  sharded = variant(base, mesh=parallel.mesh_from_string(mesh_spec))
  x = tokens(jax.random.key(2))
  (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = (output_and_grads(sharded, x, lambda m, x: m(x)[0]),
                                             base_output_and_grads(2))
  assert rel(y, y_ref) <= 1e-5 and rel(dx, dx_ref) <= 1e-5
  for g, g_ref in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_ref)):
    assert rel(g, g_ref) <= 1e-5


def test_expert_parallel_ignores_what_the_experts_leave_in_rows_past_the_groups():
  """A device receives up to every peer's slots; rows past what arrived are unspecified after the grouped GEMMs
  (the Mosaic kernels leave them unwritten). NaN there changes neither the routed outputs nor any gradient."""
  t, k, e, l, h = 64, 2, 8, 8, 4
  keys = jax.random.split(jax.random.key(12), 5)
  ids = jnp.stack([jax.random.permutation(key, e)[:k] for key in jax.random.split(keys[0], t)])
  args = (jax.random.normal(keys[1], (t, l)), jax.random.uniform(keys[2], (t, k), minval=0.1, maxval=1.0),
          jax.random.normal(keys[3], (e, l, 2 * h)), jax.random.normal(keys[4], (e, h, l)))
  clean = functools.partial(expert_ffn, options=GroupedGemmOptions("xla"))

  def poisoned(x_ML, group_sizes_G, *weights):
    y_ML = clean(x_ML, group_sizes_G, *weights)
    assert y_ML.shape[0] > t * k // 4  # rows for every peer's slots: more than arrive
    return jnp.where((jnp.arange(y_ML.shape[0]) < jnp.sum(group_sizes_G))[:, None], y_ML, jnp.nan)

  def routed(expert_fn, mesh):
    @jax.jit   # one program each way (op by op, the shard_map's VJP dispatched for tens of seconds)
    def f(z, w, wg, wd):
      if mesh is None:
        return parallel.local_routed_outputs(z, ids, w, (wg, wd), num_experts=e, expert_fn=expert_fn)
      return parallel.expert_parallel_routed_outputs(z, ids, w, (wg, wd), mesh=mesh, num_experts=e,
                                                     expert_fn=expert_fn)
    return f
  cot = jax.random.normal(jax.random.key(13), (t, l))
  (u, vjp), (u_ref, vjp_ref) = (jax.vjp(routed(fn, mesh), *args) for fn, mesh in (
      (poisoned, parallel.mesh_from_string("data:2,expert:4")), (clean, None)))
  assert bool(jnp.all(jnp.isfinite(u))) and rel(u, u_ref) <= 1e-5
  for g, g_ref in zip(vjp(cot), vjp_ref(cot)):
    assert bool(jnp.all(jnp.isfinite(g))) and rel(g, g_ref) <= 1e-5


def test_expert_parallel_layer_works_on_an_explicit_mesh(base):
  mesh = jax.make_mesh((2, 4), (parallel.DATA, parallel.EXPERT))
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  assert rel(forward(variant(base, mesh=mesh), tokens(jax.random.key(2))), base_output_and_grads(2)[0]) <= 1e-5


def test_mesh_and_divisibility_errors(base):
  with pytest.raises(ValueError, match="not divisible by the expert-parallel size 8"):
    variant(base, num_experts=4, mesh=parallel.mesh_from_string("data:1,expert:8"))
  with pytest.raises(ValueError, match="not divisible by the 8 devices"):
    variant(base, mesh=parallel.mesh_from_string("data:2,expert:4"))(tokens(jax.random.key(4), b=1, t=12))
  with pytest.raises(ValueError, match="needs 16 devices"):
    parallel.mesh_from_string("data:4,expert:4")
  with pytest.raises(ValueError, match="exactly the axes"):
    parallel.mesh_from_string("data:2,model:4")
  with pytest.raises(ValueError, match="must look like"):
    parallel.mesh_from_string("data=2")


def test_gpu_path_lowers_for_cuda_with_its_gradient(monkeypatch):
  """The GPU path (jax.lax.ragged_all_to_all, which XLA:CPU cannot run, and the Mosaic grouped GEMMs) traces,
  differentiates and lowers to CUDA inside the expert-parallel shard_map."""
  monkeypatch.setattr(ops, "products", lambda backend, k, n, dtype, configs=None: ops.MosaicProducts(Configs()))
  mesh = parallel.mesh_from_string("data:2,expert:4")
  monkeypatch.setattr(jax, "devices", lambda *a, **kw: [types.SimpleNamespace(core_count=132)])  # SM count
  t, k, l, e, h = 64, 2, 128, 8, 128
  keys = jax.random.split(jax.random.key(5), 4)
  ids = jax.random.randint(keys[0], (t, k), 0, e)

  def loss(z, weights, w_gate_up, w_down):
    y = parallel.expert_parallel_routed_outputs(z, ids, weights, (w_gate_up, w_down), mesh=mesh, num_experts=e,
                                                expert_fn=expert_ffn, a2a_impl="ragged")
    return jnp.sum(y.astype(jnp.float32) ** 2)
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
      ((t, l), jnp.bfloat16), ((t, k), jnp.float32), ((e, l, 2 * h), jnp.bfloat16), ((e, h, l), jnp.bfloat16))]
  exported = jax.export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
  module = exported.mlir_module()
  assert module.count("custom_call @ragged_all_to_all") == 4  # there and back, and both transposed
  assert module.count("mosaic_gpu") >= 6  # two expert GEMMs, each forward, dX and dW


def test_mesh_spec_fills_the_free_axis_and_rejects_bad_specs():
  devices = jax.devices()[:8]
  shape = lambda spec: dict(parallel.mesh_from_string(spec, devices).shape)
  assert shape("data:-1,expert:1") == {"data": 8, "expert": 1}
  assert shape("expert:2, data:-1") == {"data": 4, "expert": 2}
  assert shape("data:2,expert:2") == {"data": 2, "expert": 2}
  for bad in ("data:-1,expert:-1", "data:3", "data:2,model:2", "data:0,expert:1", "data:x,expert:1"):
    with pytest.raises(ValueError, match="mesh"):
      parallel.mesh_from_string(bad, devices)
  with pytest.raises(ValueError, match="not divisible"):
    parallel.mesh_from_string("data:-1,expert:3", devices)
