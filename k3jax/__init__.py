"""k3jax: the Kimi K3 architecture in JAX / Flax NNX. `k3jax.load(workdir)` gives a trained run's model."""

__all__ = ["load"]


def __getattr__(name):
  if name == "load":   # imported on first use: `import k3jax` stays free of JAX
    from k3jax.api import load
    return load
  raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
