"""KDA (Kimi Delta Attention), the op's Python side: the entry points (`api`), the reference recurrence (`naive`),
the chunked XLA path (`chunk`), the gate and pre-pass (`gate`), and what all of them and the Pallas kernels share
(`common`). The kernels are in `pallas_kernels/kda/`; `testing` holds the probes the tests and benchmarks share."""
from k3jax.ops.kda.api import BACKENDS, FUSED_INPUTS, chunk_kda, fused_kda, kda_decode_step
from k3jax.ops.kda.common import RESIDUALS_NAME, SAFE_LOWER_BOUND, check_inputs, reset_mask
from k3jax.ops.kda.gate import fused_inputs, kda_gate, l2_normalize
from k3jax.ops.kda.naive import naive_recurrent_kda

__all__ = ["BACKENDS", "FUSED_INPUTS", "RESIDUALS_NAME", "SAFE_LOWER_BOUND", "check_inputs", "chunk_kda",
           "fused_inputs", "fused_kda", "kda_decode_step", "kda_gate", "l2_normalize", "naive_recurrent_kda",
           "reset_mask"]
