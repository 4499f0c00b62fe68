"""The routed experts' SiTU-GLU in the grouped GEMMs' epilogues (`glu_ffn`, Mosaic GPU) on a Hopper GPU: the
expert's output and its three gradients against the fp32 formula, each held to the error of the unit between the
products (the Mosaic products with XLA's bf16 unit between them, the path before the fusion) on the same inputs,
which is itself held to a bound that a misplaced row would break. `small`'s expert shape (ℓ = 384, 512 units, 64
experts) on fewer rows, random group sizes with empty groups, a row count no tile divides, and units deep in
saturation.
"""
import jax
import jax.numpy as jnp
import pytest

from k3jax.layers.ffn import SiTU
from k3jax.layers.moe import expert_ffn
from k3jax.numerics import rel_err
from pallas_kernels.grouped_gemm import GroupedGemmOptions, mosaic
from pallas_kernels.grouped_gemm.ops import glu_ffn_reference

pytestmark = pytest.mark.gpu

K, H, G = 384, 512, 64
MAX_REL_ERR = 0.1   # a bf16 expert's error, with room: a row the kernels store in the wrong place is off by O(1)
CASES = {"routed rows": (16384, 1.0), "rows no tile divides": (5000, 1.0), "saturated units": (8192, 4.0)}


def _operands(m, scale):
  keys = jax.random.split(jax.random.key(m), 5)
  sizes = jax.random.multinomial(keys[0], m, jax.random.dirichlet(keys[1], jnp.full((G,), 0.3))).astype(jnp.int32)
  x = jax.random.normal(keys[2], (m, K)).astype(jnp.bfloat16)
  w = (scale * K ** -0.5 * jax.random.normal(keys[3], (G, K, 2 * H))).astype(jnp.bfloat16)
  w_down = (H ** -0.5 * jax.random.normal(keys[4], (G, H, K))).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.fold_in(keys[4], 1), (m, K)).astype(jnp.bfloat16)
  return sizes, x, w, w_down, dy


@pytest.mark.parametrize("case", CASES)
def test_the_unit_in_the_epilogues_is_held_to_the_unfused_experts_error(case):
  if mosaic.mosaic_gpu_reason() is not None:
    pytest.skip(mosaic.mosaic_gpu_reason())
  m, scale = CASES[case]
  sizes, x, w, w_down, dy = _operands(m, scale)
  assert int(jnp.min(sizes)) == 0 and int(jnp.sum(sizes)) == m
  f32 = lambda a: a.astype(jnp.float32)
  want, want_vjp = jax.vjp(lambda x, w, wd: glu_ffn_reference(x, w.reshape(G, K, 2, H), wd, sizes, SiTU()),
                           f32(x), f32(w), f32(w_down))
  wants = (want, *want_vjp(f32(dy)))
  errors = {}
  for name, options in (("fused", GroupedGemmOptions()), ("unfused", GroupedGemmOptions(glu_tiles=None))):
    assert options.fuses_glu(K, H, jnp.bfloat16) == (name == "fused")
    def run(x, w, wd, dy, o=options):
      y, vjp = jax.vjp(lambda *a: expert_ffn(a[0], sizes, a[1], a[2], options=o, rows_past_groups=False), x, w, wd)
      return (y, *vjp(dy))
    got = jax.jit(run)(x, w, w_down, dy)
    assert all(bool(jnp.all(jnp.isfinite(f32(g)))) for g in got), name
    errors[name] = [rel_err(g, r) for g, r in zip(got, wants)]
  for part, e_fused, e_unfused in zip(("y", "dx", "dw_gate_up", "dw_down"), errors["fused"], errors["unfused"]):
    assert e_fused <= 1.1 * e_unfused, (part, errors)
    assert e_unfused <= MAX_REL_ERR, (part, errors)   # both paths share the plain kernels: neither may be wrong
