"""Test-wide set-up: 8 simulated CPU devices (expert/data-parallel tests) before JAX initialises."""
import os

flag = "--xla_force_host_platform_device_count=8"
if flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
# CPU tests are dominated by compile time (Pallas interpret mode especially); LLVM's -O0 compiles ~3x faster.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
