"""Generation: greedy tokens are the argmax of full forwards; sampling is reproducible and in range; bad input."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import generate_lib
from k3jax.generate import generate
from model_testing import SCANNED, T, T0, shared_model

full_forward = nnx.jit(lambda m, tokens: m(tokens)[0])


@pytest.mark.parametrize("layers", ["unrolled", "scanned"])
def test_greedy_generation_is_the_argmax_of_full_forwards(layers):
  model = shared_model() if layers == "unrolled" else shared_model(tuple(SCANNED.items()))
  assert model.plan.num_groups == (2 if layers == "scanned" else 0)
  prompt = jax.random.randint(jax.random.PRNGKey(0), (2, T0), 0, 64)
  new = generate(model, prompt, T - T0)
  chex.assert_shape(new, (2, T - T0))
  chex.assert_type(new, jnp.int32)
  # The model is causal, so one forward over prompt + generated tokens gives every step's full-forward logits.
  logits = full_forward(model, jnp.concatenate([prompt, new], axis=1))
  np.testing.assert_array_equal(new, jnp.argmax(logits[:, T0 - 1:T - 1], axis=-1))


def test_sampling_is_reproducible_in_range_and_depends_on_the_key():
  model = shared_model()
  prompt = jax.random.randint(jax.random.PRNGKey(1), (2, T0), 0, 64)
  a = generate(model, prompt, T - T0, rng=jax.random.PRNGKey(7), temperature=1.0)
  b = generate(model, prompt, T - T0, rng=jax.random.PRNGKey(7), temperature=1.0)
  c = generate(model, prompt, T - T0, rng=jax.random.PRNGKey(8), temperature=1.0)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert int(a.min()) >= 0 and int(a.max()) < 64


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=jnp.zeros((2, 3), jnp.float32)), "prompt_BT must be a non-empty integer array"),
    (dict(prompt=jnp.zeros((3,), jnp.int32)), "prompt_BT must be a non-empty integer array"),
    (dict(num_tokens=0), "num_tokens must be a positive int"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=0.5), "sampling \\(temperature > 0\\) needs rng"),
    (dict(prompt=jnp.zeros((1, 0), jnp.int32)), "prompt_BT must be a non-empty integer array"),
    (dict(top_p=0.0), "top_p must lie in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must lie in \\(0, 1\\]"),
    (dict(max_len=4), "max_len=4 cannot hold the prompt \\(3 tokens\\) and 2 new tokens"),
    (dict(prompt=jnp.full((1, 3), 64, jnp.int32)), "prompt tokens must lie in \\[0, vocab_size=64\\)"),
    (dict(prompt=jnp.full((1, 3), -1, jnp.int32)), "prompt tokens must lie in \\[0, vocab_size=64\\)"),
])
def test_bad_arguments_raise_clear_errors_before_any_compute(kwargs, match, monkeypatch):
  args = dict(prompt=jnp.zeros((1, 3), jnp.int32), num_tokens=2, temperature=0.0)
  args.update(kwargs)
  ran = []
  monkeypatch.setattr(generate_lib, "prefill_chunked", lambda *a, **k: ran.append(1))
  with pytest.raises(ValueError, match=match):
    generate(shared_model(), args.pop("prompt"), args.pop("num_tokens"), **args)
  assert not ran
