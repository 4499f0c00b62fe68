"""Stopping on signals (k3jax/train/interrupt.py): inside StopSignals the first SIGINT or SIGTERM is only recorded
(the loop stops at the next step boundary) and the second ends the process at once; outside, the handlers are
the previous ones. (A real training run interrupted by SIGINT is in test_train_loop.py.)"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from k3jax.train import interrupt
from train_testing import REPO


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_is_recorded_and_stops_at_the_next_check(signum, code, capfd):
  handler = signal.getsignal(signum)
  with interrupt.StopSignals() as stop:
    stop.check(3)                      # nothing requested: no stop
    os.kill(os.getpid(), signum)
    assert stop.requested() == signum
    with pytest.raises(interrupt.Interrupted) as e:
      stop.check(7)
  assert (e.value.step, e.value.exit_code) == (7, code) and "stopped at step 7" in str(e.value)
  assert isinstance(e.value, KeyboardInterrupt)          # what `except Exception` leaves alone
  assert signal.getsignal(signum) is handler
  assert "stopping after the current step" in capfd.readouterr().err


def test_a_second_sigint_ends_the_process_at_once():
  script = textwrap.dedent("""
      import os, signal, time
      from k3jax.train import interrupt
      with interrupt.StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        print("first signal recorded", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("still running", flush=True)
      """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGINT, proc.stdout + proc.stderr
  assert "first signal recorded" in proc.stdout and "still running" not in proc.stdout
