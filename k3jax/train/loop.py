"""The step loop that a training stage and the RL iterations both run: advance, checkpoint on a cadence, at the end
and when a stop is requested, then stop cleanly."""
from __future__ import annotations

from typing import Any, Callable

from k3jax.train import checkpoint, interrupt, metrics as metrics_lib


def run_steps(state, steps: range, advance: Callable[[Any, int], Any], *, ckpt: checkpoint.Checkpointer,
              stop: interrupt.StopSignals, checkpoint_every: int, save_meta: Callable[[int], dict],
              progress: metrics_lib.Progress, before_save: Callable[[int], None] = lambda done: None):
  """`state = advance(state, step)` for each of `steps` (the caller logs, checks and reports inside it); after step
  `s`, with `done = s + 1`, a checkpoint of `state` with `save_meta(done)` every `checkpoint_every` steps, at the last
  of `steps` and when a stop is requested, `before_save(done)` first (it may refuse by raising). After a stop's save
  is on disk, `interrupt.Interrupted`. Closes `progress`; returns the state after the last step, every save on disk."""
  try:
    for s in steps:
      state = advance(state, s)
      done = s + 1
      signum = stop.requested()
      if signum or done % checkpoint_every == 0 or done == steps.stop:
        before_save(done)
        ckpt.save(done, state, save_meta(done))
      if signum:
        ckpt.wait()
        raise interrupt.Interrupted(signum, done)
  finally:
    progress.close()
  ckpt.wait()
  return state
