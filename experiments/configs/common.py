"""Fields every experiment config shares; each config file starts from `base_config()` and fills `model`."""
import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 100
  c.log_every = 10
  c.checkpoint_every = 50
  c.model = ml_collections.ConfigDict()
  return c
