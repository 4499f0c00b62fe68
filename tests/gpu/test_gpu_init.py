"""The train state's init on the GPU (`state.InitProgram`): its draws lowered to threefry's GPU kernel give the
state, bit for bit, that threefry's rounds lowered as HLO (the jit of the same init without the option) give, and
the compiled program holds the kernel. A model with every kind of layer: KDA and MLA, a dense and MoE FFNs, scanned
groups, so every initialiser's shapes are drawn. The CPU's counterpart checks the lowering alone
(tests/train/test_state.py): there the option changes nothing to compare."""
import jax
import numpy as np
import optax
import pytest
from jax._src import config as jax_config

from experiments.configs import common
from k3jax import parallel
from k3jax.train import state as state_lib
from model_testing import SCANNED, small_config

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="threefry's kernel lowering exists only on the GPU")
def test_the_init_on_threefrys_kernel_is_bitwise_the_init_on_its_rounds():
  c = common.base_config()
  c.model, c.mesh = small_config(**SCANNED), "data:1,expert:1"
  mesh = parallel.mesh_from_string(c.mesh)
  _, abstract, init = state_lib.abstract_state(c, optax.adamw(1e-3), mesh)
  program = state_lib.InitProgram(init, abstract, mesh)
  with jax_config.threefry_gpu_kernel_lowering(False):
    rounds = jax.jit(init, out_shardings=state_lib.shardings_of(abstract)).lower(np.int32(3)).compile()
  kernel = program.lower(np.int32(3)).compile()
  assert "cu_threefry2x32_ffi" in kernel.as_text() and "cu_threefry2x32_ffi" not in rounds.as_text()
  got, want = jax.device_get(program(np.int32(3))), jax.device_get(rounds(np.int32(3)))
  leaves = jax.tree_util.tree_flatten_with_path(want)[0]
  assert len(leaves) == len(jax.tree.leaves(got)) > 50
  for (path, w), g in zip(leaves, jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
