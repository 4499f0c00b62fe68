"""`KDAKernelOptions`: bad values refused at construction, each launch's parameters reaching its kernel (and only
its own), the shipped launch defaults, and the per-call defaults of blocks and segments."""
import jax
import jax.numpy as jnp
import pytest

from k3jax.ops import kda
from pallas_kernels import triton_launches
from pallas_kernels.kda import KDAKernelOptions, Launch, chunk
from pallas_kernels.kda.options import DEFAULT_LAUNCHES

SHAPES = dict(q=(1, 128, 2, 32), k=(1, 128, 2, 32), v=(1, 128, 2, 32), g=(1, 128, 2, 32), beta=(1, 128, 2))


def _grad_launches(options, dtype=jnp.float32):
  x = {n: jax.ShapeDtypeStruct(s, dtype) for n, s in SHAPES.items()}
  run = lambda x: kda.chunk_kda(**x, lower_bound=-5.0, backend="pallas", kernel_options=options)[0]
  return triton_launches(jax.grad(lambda x: run(x).astype(jnp.float32).sum()), x)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cols_form="tiled"), "cols_form must be one of"),
    (dict(solve="fuse"), "solve must be one of"),
    (dict(state_pass="cuda"), "state_pass must be one of"),
    (dict(bwd_block_k=0), "bwd_block_k must be a positive integer"),
    (dict(segments=2.0), "segments must be a positive integer"),
    (dict(prepare=(4,)), "prepare must be a Launch"),
    (dict(intra_bwd_cols=Launch(0, 1)), "intra_bwd_cols must be a Launch"),
])
def test_bad_options_are_refused_when_made(kwargs, match):
  with pytest.raises(ValueError, match=match):
    KDAKernelOptions(**kwargs)


def test_every_launch_takes_its_options_parameters_and_only_its_own():
  """The forward and backward of the fp32 op (Triton solve and state passes): with no options each kernel runs its
  default launch; with one kernel's launch given, that kernel alone changes."""
  defaults = _grad_launches(None)
  assert defaults == {"kda_prepare": (4, 1), "kda_intra_fwd_key_tiles": (2, 3), "kda_intra_fwd_solve": (4, 1),
                      "kda_state_fwd": (4, 2), "kda_state_bwd": (4, 2), "kda_state_grads": (4, 1),
                      "kda_intra_bwd_rows": (4, 1), "kda_intra_bwd_cols": (4, 3), "kda_intra_bwd_dg": (4, 1)}
  assert set(DEFAULT_LAUNCHES) == {n.removeprefix("kda_") for n in defaults} | {"state_segment_maps"}
  for name in ("intra_fwd_key_tiles", "intra_bwd_cols", "state_bwd", "prepare"):
    got = _grad_launches(KDAKernelOptions(**{name: Launch(8, 3)}))
    assert got == {**defaults, f"kda_{name}": (8, 3)}, name


def test_partial_launches_merge_over_the_defaults_and_unknown_kernels_are_named():
  options = KDAKernelOptions().with_launches(prepare={"num_warps": 8}, intra_fwd_key_tiles=Launch(4, 2))
  assert options.launch("prepare") == Launch(8, 1) and options.launch("intra_fwd_key_tiles") == Launch(4, 2)
  assert options.state_bwd_launch(128) == Launch(8, 2) and options.state_bwd_launch(64) == Launch(4, 2)
  with pytest.raises(ValueError, match=r"no kernel launch named \['kda_prepare'\]"):
    KDAKernelOptions().with_launches(kda_prepare=Launch(4, 1))
  with pytest.raises(ValueError, match="depends on the call"):
    KDAKernelOptions().with_launches(state_bwd={"num_stages": 3})


def test_defaults_resolve_per_call_and_refuse_segments_that_do_not_divide():
  assert chunk.default_block_v(8, 16, 128) == 128 and chunk.default_block_v(1, 16, 128) == 16
  assert chunk.default_segments(1, 16, 1024) == 8 and chunk.default_segments(8, 16, 64) == 1
  x = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  with pytest.raises(ValueError, match="segments=3 must divide the 2 chunks"):
    kda.chunk_kda(**x, lower_bound=-5.0, backend="pallas", kernel_options=KDAKernelOptions(segments=3))
  with pytest.raises(TypeError, match="must be a KDAKernelOptions"):
    kda.chunk_kda(**x, lower_bound=-5.0, backend="pallas", kernel_options={"segments": 1})
