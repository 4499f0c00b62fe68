"""The LatentMoE layer shared by the MoE layer's and the expert-parallel tests: a small fp32 config, one layer
with a non-zero balancer bias (built once per process), its copies on other meshes / dtypes / configs, and one-jit
outputs and gradients."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

from k3jax import balancer
from k3jax.layers.moe import LatentMoE

D = 16


def moe_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(
      enabled=True, num_experts=8, top_k=2, num_shared_experts=2, expert_hidden=8, shared_hidden=6, latent_dim=8,
      routed_scaling=2.0, balancer="quantile", balancer_eta=1.0, balancer_method="exact", aux_loss_coef=1e-2,
      sign_update_rate=1e-3, first_dense_layers=1))
  c.update(overrides)
  return c


@functools.cache
def base_layer():
  """One fp32 layer with a non-zero balancer bias, built once per process (building is slow on the CPU);
  variants copy its state."""
  layer = LatentMoE(D, moe_config(), rngs=nnx.Rngs(0), dtype=jnp.float32)
  layer.balancer.set_value(balancer.State(bias=0.05 * jax.random.normal(jax.random.key(1), (8,))))
  return layer


@pytest.fixture
def base():
  return base_layer()


@functools.cache
def base_output_and_grads(seed):
  """The single-device layer's output and gradients on tokens(key(seed)) (once per process)."""
  return output_and_grads(base_layer(), tokens(jax.random.key(seed)), lambda m, x: m(x)[0])


def variant(base, dtype=jnp.float32, mesh=None, **cfg):
  layer = nnx.eval_shape(lambda: LatentMoE(D, moe_config(**cfg), rngs=nnx.Rngs(0), dtype=dtype, mesh=mesh))
  nnx.update(layer, nnx.state(base))
  return layer


def tokens(key, b=2, t=16):
  return jax.random.normal(key, (b, t, D))


def rel(a, b):
  return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b ** 2)))


def output_and_grads(layer, x, fn):
  """fn(layer, x) and the gradients of a random projection of it, w.r.t. the params and x (one jit)."""
  graph, params, rest = nnx.split(layer, nnx.Param, ...)
  cot = jax.random.normal(jax.random.key(7), x.shape)

  def loss(params, x):
    y = fn(nnx.merge(graph, params, rest), x)
    return jnp.sum(y * cot), y
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


def forward(layer, x, fn=lambda m, x: m(x)[0]):
  graph, state = nnx.split(layer)
  return jax.jit(lambda state, x: fn(nnx.merge(graph, state), x))(state, x)
