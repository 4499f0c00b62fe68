"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (a preempted machine).

Inside `StopSignals`, the first signal only sets a flag: the training loop finishes its step, saves a checkpoint
of it, closes its writers and raises `Interrupted`, which scripts turn into exit status 128 + signal (130, 143).
The first signal also restores the default action, so a second one ends the process at once, even while it waits
inside a compile or a device call (where no Python handler runs).
"""
from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal after saving the step it had reached (`step`)."""

  def __init__(self, signum: int, step: int):
    self.signum, self.step = signum, step
    super().__init__(f"{signal.Signals(signum).name}: stopped at step {step} with a checkpoint of it; run the same "
                     f"command again to continue")

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


class StopSignals:
  """Context in which SIGINT / SIGTERM ask for a stop (see the module docstring); a no-op off the main thread,
  where Python cannot install signal handlers."""

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    self.signum = self.signum or signum
    for s in SIGNALS:
      signal.signal(s, signal.SIG_DFL)
    # os.write: a handler may run in the middle of a print, and the buffered streams are not reentrant.
    os.write(2, f"\n{signal.Signals(signum).name}: stopping after the current step and saving a checkpoint of it "
                f"(send it again to exit at once, without saving)\n".encode())

  def requested(self) -> int | None:
    """The signal received (by any process of a multi-process run: each then stops at the same step), or None."""
    signum = self.signum or 0
    if jax.process_count() > 1:
      signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    return signum or None

  def check(self, step: int) -> None:
    """Raises `Interrupted` at `step` if a stop was requested (the caller has saved `step`)."""
    signum = self.requested()
    if signum:
      raise Interrupted(signum, step)
