"""The intra backward (interpret mode), each form of its column pass and several K blocks: the gradients of the
intra pass's outputs by autodiff of their float64 definitions, given the same cotangents."""
import chex
import jax
import pytest

from k3jax.numerics import rel_err
from kda_kernel_testing import dA_qk, kernel_case, launches, reference_intra_gradients
from pallas_kernels.kda import KDAKernelOptions, bwd
from pallas_kernels.kda.options import COLS_FORMS


def _cotangents(seed, B, T, H, K, V):
  """Random v_new, dv_new, dO, dW, dQs, dKd `[B,T,H,·]` and d decay `[B,N,H,K]`."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  vn, dvn, do = (jax.random.normal(ks[i], (B, T, H, V)) for i in range(3))
  dw, dqs, dkd = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3, 6))
  return vn, dvn, do, dw, dqs, dkd, jax.random.normal(ks[6], (B, T // 64, H, K))


def _check(x, reset, seed, shape, options_list, tol):
  B, T, H, K, V = shape
  scale = K ** -0.5
  intra = launches(x, reset, scale=scale, lower_bound=-5.0)
  vn, dvn, do, dw, dqs, dkd, dd = _cotangents(seed, *shape)
  ref = reference_intra_gradients(x, reset, (dw, dvn, dqs, dkd, dA_qk(do, vn), dd), scale=scale)
  for options in options_list:
    outs = bwd.intra_backward(q=x["q"], k=x["k"], v=x["v"], loc=intra["loc"], beta=x["beta"], reset=reset,
                              u=intra["u"], w=intra["w"], kk=intra["kk"], minv=intra["minv"], v_new=vn, dv_new=dvn,
                              do=do, dw=dw, dqs=dqs, dkd=dkd, dd=dd, scale=scale, lower_bound=-5.0, options=options)
    chex.assert_tree_all_finite(outs)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), outs, ref):
      assert rel_err(a, b) <= tol(name), (options.cols_form, options.bwd_block_k, name, rel_err(a, b))


@pytest.mark.parametrize("case", ["random_with_resets", "gates_at_bound", "repeated_keys"])
def test_intra_backward_is_the_gradient_of_the_intermediates(case):
  """Both column-pass forms, K = 32 in two blocks, resets mid-tile, at a tile start and at a chunk start. With every
  gate at the bound dg cancels ~500x, so its summation order shows."""
  shape = (1, 128, 1, 32, 32)
  x, reset = kernel_case(27, case, *shape)
  tol = lambda name: 5e-5 if (name, case) == ("dg", "gates_at_bound") else 1e-5
  _check(x, reset, 28, shape, [KDAKernelOptions(bwd_block_k=16, cols_form=form) for form in COLS_FORMS], tol)


def test_k_unlike_v_and_several_column_blocks_give_the_gradients():
  """K = 128 in four 32-column blocks of the column pass and dg's sum, V = 32, with resets."""
  shape = (1, 128, 1, 128, 32)
  x, reset = kernel_case(29, "random_with_resets", *shape)
  _check(x, reset, 30, shape, [KDAKernelOptions(bwd_block_k=32)], lambda name: 1e-5)
