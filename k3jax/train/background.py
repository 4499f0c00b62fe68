"""Jobs in threads beside the main one: the thread form of compiling side by side (XLA compiles outside the GIL, so
compiles started from threads overlap; tracing does not, for that see `benchmark.side_by_side`)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence


class Background:
  """`jobs` started at once, each in a daemon thread (a run that stops does not wait for a compile). `wait()`
  returns their results in order and re-raises the first failure in the caller's thread."""

  def __init__(self, jobs: Sequence[Callable[[], Any]]):
    self.results: list[Any] = [None] * len(jobs)
    self.errors: list[BaseException] = []
    self.threads = [threading.Thread(target=self._run, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for t in self.threads:
      t.start()

  def _run(self, i, job):
    try:
      self.results[i] = job()
    except BaseException as e:   # re-raised by wait(), in the caller's thread
      self.errors.append(e)

  def wait(self) -> list[Any]:
    for t in self.threads:
      t.join()
    if self.errors:
      raise self.errors[0]
    return self.results
