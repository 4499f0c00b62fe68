"""The train state: its init is one program for every seed, and gives each seed the parameters of `nnx.Rngs(seed)`."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src import config as jax_config

from experiments.configs import common
from k3jax import parallel
from k3jax.model import K3Model
from k3jax.train import state as state_lib, trainer
from model_testing import MODEL, small_config


def _config(seed=0):
  c = common.base_config()
  c.model, c.mesh, c.seed = small_config(**MODEL, vocab_size=260), "data:1,expert:1", seed
  return c


def test_init_is_one_program_for_every_seed_and_gives_each_seed_its_rngs_parameters():
  c = _config()
  mesh = parallel.mesh_from_string(c.mesh)
  _, abstract, init = state_lib.abstract_state(c, optax.adam(1e-3), mesh)
  program = state_lib.InitProgram(init, abstract, mesh)
  assert program.lower(np.int32(0)).as_text() == program.lower(np.int32(5)).as_text()
  params = {}
  for seed in (0, 5):
    state = program(np.int32(seed))
    _, eager, _, _ = state_lib.split(K3Model(c.model, rngs=nnx.Rngs(seed), mesh=mesh))
    # The same draws; the compiled program may round the scaling of a draw differently from the eager one.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), state.params, eager)
    params[seed] = state.params
  assert not np.array_equal(params[0]["embed"].get_value(), params[5]["embed"].get_value())


def test_the_init_lowers_its_draws_for_the_gpu_to_threefrys_kernel_not_to_its_rounds():
  c = _config()
  mesh = parallel.mesh_from_string(c.mesh)
  _, abstract, init = state_lib.abstract_state(c, optax.adam(1e-3), mesh)
  text = state_lib.InitProgram(init, abstract, mesh).lower(np.int32(0), platforms=("cuda",)).as_text()
  with jax_config.threefry_gpu_kernel_lowering(False):
    rounds = jax.jit(init).trace(np.int32(0)).lower(lowering_platforms=("cuda",)).as_text()
  assert "cu_threefry2x32_ffi" in text and "shift_left" not in text
  assert "cu_threefry2x32_ffi" not in rounds and "shift_left" in rounds   # what the option changes


def test_a_run_builds_the_state_of_its_configs_seed():
  runs = [trainer.Run(_config(seed)) for seed in (0, 5, 5)]
  embeds = [np.asarray(r.init().params["embed"].get_value()) for r in runs]
  assert not np.array_equal(embeds[0], embeds[1])
  np.testing.assert_array_equal(embeds[1], embeds[2])


@pytest.mark.parametrize("seed", [-1, 2 ** 31])
def test_a_seed_the_init_program_cannot_take_is_rejected(seed):
  with pytest.raises(ValueError, match="config.seed"):
    trainer.Run(_config(seed))
