"""k3jax/train/loop.py: the step loop of the trainer and the RL iterations; its saves' cadence, the check before a
save, and a requested stop."""
import signal

import pytest

from k3jax.train import interrupt, loop


class _Checkpoints:
  def __init__(self):
    self.saved, self.waits = [], 0

  def save(self, step, state, meta):
    self.saved.append((step, state, meta))

  def wait(self):
    self.waits += 1


class _Stop:
  def __init__(self, at=None):
    self.at, self.step = at, 0

  def requested(self):
    self.step += 1
    return signal.SIGTERM if self.step == self.at else None


class _Progress:
  closed = False

  def close(self):
    self.closed = True


def _run(steps, stop, before_save=lambda done: None):
  ckpt, progress = _Checkpoints(), _Progress()
  try:
    state = loop.run_steps(0, steps, lambda state, s: state + s, ckpt=ckpt, stop=stop, checkpoint_every=3,
                           save_meta=lambda done: {"done": done}, progress=progress, before_save=before_save)
  except interrupt.Interrupted as e:
    state = e
  return state, ckpt, progress


def test_saves_every_n_steps_and_at_the_last_with_the_state_after_that_step():
  checked = []
  state, ckpt, progress = _run(range(2, 9), _Stop(), before_save=checked.append)
  assert state == sum(range(2, 9)) and progress.closed and ckpt.waits == 1
  assert [(step, meta["done"]) for step, _, meta in ckpt.saved] == [(3, 3), (6, 6), (9, 9)]
  assert [s for _, s, _ in ckpt.saved] == [2, 2 + 3 + 4 + 5, sum(range(2, 9))] and checked == [3, 6, 9]


def test_a_requested_stop_saves_the_step_reached_waits_and_raises():
  stopped, ckpt, progress = _run(range(0, 10), _Stop(at=5))
  assert isinstance(stopped, interrupt.Interrupted) and stopped.step == 5 and progress.closed
  assert [step for step, _, _ in ckpt.saved] == [3, 5] and ckpt.waits == 1


def test_a_refused_save_saves_nothing_and_closes_the_progress():
  def refuse(done):
    if done == 6:
      raise FloatingPointError("diverged")
  ckpt, progress = _Checkpoints(), _Progress()
  with pytest.raises(FloatingPointError):
    loop.run_steps(0, range(8), lambda state, s: state + 1, ckpt=ckpt, stop=_Stop(), checkpoint_every=3,
                   save_meta=lambda done: {}, progress=progress, before_save=refuse)
  assert [step for step, _, _ in ckpt.saved] == [3] and progress.closed
