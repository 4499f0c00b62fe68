"""k3jax/train/background.py: jobs in threads, their results in order, a failure re-raised in the caller."""
import threading

import pytest

from k3jax.train import background


def test_jobs_run_at_once_and_return_in_order():
  barrier = threading.Barrier(3, timeout=30)   # passes only if all three jobs run at the same time
  jobs = [lambda i=i: (barrier.wait(), i * i)[1] for i in range(3)]
  assert background.Background(jobs).wait() == [0, 1, 4]


def test_a_failure_is_raised_by_wait_after_every_job_ended():
  done = []
  def fail():
    raise KeyError("bad job")
  jobs = [fail, lambda: done.append(1)]
  with pytest.raises(KeyError, match="bad job"):
    background.Background(jobs).wait()
  assert done == [1]
