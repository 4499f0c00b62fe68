"""Training throughput (tokens/s, MFU) of a config at its stages' sequence lengths, with its own layer pattern and
with every layer MLA (or KDA), in one call: each variant compiles in its own process, all at once, then they run
one at a time (`benchmark.measure_in_turn`):

  python -m experiments.bench_train --config=small --seq_lens=4096,16384,65536 --patterns=config,mla --profile \
      --compilation_cache=runs/xla_cache --out=$OUT/bench_train.json

`--config` is a name under experiments/configs/ or a .py path (overrides: `--config.model.remat=false`). Without
`--seq_lens` the variants are the config's stages (their lengths and batch sizes); `--seq_lens` alone keeps the
config's tokens per step. `--profile` also traces a few steps per variant and prints their device time by kind of
kernel (GEMM, grouped GEMM, attention, KDA, dispatch, collective, other) with launch counts and the glue's share
(`k3jax/train/profile.py`); `--profile_compile` traces each compile and prints XLA's phases by seconds.
`--documents=data --documents=one` times each compiled step on the mixture's rows and on rows of one document each.
`--variant=NAME:FIELD=VALUE[,...]` (repeatable) adds the config with those fields changed beside it, e.g.
`--variant=scanned:model.scan_layers=True,model.remat=save_attention --variant=barrier:model.residual.backward=barrier`.
"compile s" is the train step's, from tracing to compiled (the JSON also has its trace and lower, and the init's
compile). MFU = tokens/s · flops/token / (peak dense bf16 FLOP/s · devices), flops/token as in
k3jax/train/flops.py; a CPU reports no MFU.
"""
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import configs, harness
from k3jax.train import benchmark

_CONFIG = config_flags.DEFINE_config_file("config", None, "config name under experiments/configs/ or a .py path",
                                          lock_config=True)
_SEQ_LENS = flags.DEFINE_list("seq_lens", None, "sequence lengths (default: the config's stages)")
_TOKENS = flags.DEFINE_integer("tokens_per_step", None, "tokens per step, batch = tokens / seq_len (default: the "
                               "config's)")
_PATTERNS = flags.DEFINE_list("patterns", ["config", "mla"], f"layer patterns: {sorted(benchmark.PATTERNS)}")
_VARIANTS = flags.DEFINE_multi_string("variant", [], "NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. "
                                      "none:model.remat=none: the config with those fields changed, a variant of "
                                      "its own named pattern/NAME beside each pattern's unchanged config")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed steps first")
_PROFILE = flags.DEFINE_bool("profile", False, "also trace --profile_steps steps per variant: device time by kind")
_PROFILE_STEPS = flags.DEFINE_integer("profile_steps", 3, "steps traced with --profile")
_PROFILE_COMPILE = flags.DEFINE_bool("profile_compile", False, "trace each variant's XLA compile and print its "
                                     "phases (pass pipelines, autotuning, kernel compiles) by seconds")
_OUT = flags.DEFINE_string("out", None, "JSON file for the results (rewritten after each variant)")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "also write each variant's optimized HLO here (gzipped text): what "
                               "the profile's fusions hold")
_CACHE = flags.DEFINE_string("compilation_cache", "", "keep compiled programs here (e.g. runs/xla_cache): a rerun "
                             "skips them (every variant's process uses it)")
_DOCUMENTS = flags.DEFINE_multi_enum("documents", ["data"], list(benchmark.DOCUMENTS), "rows to time each step on "
                                     "(repeat the flag for both): data, as the mixture packs them; one, each row one "
                                     "document (attention at a context of the row's length)")
flags.mark_flags_as_required(["config"])


def config_path(value: str) -> str:
  """`--config`'s value as a path: a name means experiments/configs/<name>.py; anything else must be a .py file."""
  if value.endswith(".py") or "/" in value:
    if not pathlib.Path(value).is_file():
      raise app.UsageError(f"--config={value}: no such file")
    return value
  if value not in configs.names():
    raise app.UsageError(f"--config={value}: no config of that name; experiments/configs has {configs.names()}")
  return str(configs.HERE / f"{value}.py")


def parse_flags(argv):
  """absl's flag parsing, with `--config=NAME` resolved to its file first."""
  argv, resolved = list(argv), []
  while argv:
    arg = argv.pop(0)
    if arg in ("--config", "-config") and argv:
      arg = f"--config={argv.pop(0)}"
    if arg.startswith(("--config=", "-config=")):
      name, value = arg.split("=", 1)
      try:
        arg = f"{name}={config_path(value)}"
      except app.UsageError as e:
        sys.exit(f"FATAL Flags parsing error: {e}")
    resolved.append(arg)
  return app.parse_flags_with_usage(resolved)


def main(argv):
  harness.check_argv(argv)
  try:
    variants = [("", {})] + [benchmark.parse_changes(v) for v in _VARIANTS.value]
    for _, changes in variants:   # every field exists and validates, before any variant compiles
      benchmark.variant(_CONFIG.value, changes=changes)
  except ValueError as e:
    raise app.UsageError(f"--variant: {e}") from None
  harness.enable_compilation_cache(_CACHE.value)
  rows, failed = benchmark.time_variants(
      _CONFIG.value, patterns=_PATTERNS.value, seq_lens=_SEQ_LENS.value, tokens_per_step=_TOKENS.value,
      steps=_STEPS.value, warmup=_WARMUP.value, profile_steps=_PROFILE_STEPS.value if _PROFILE.value else 0,
      profile_compile=_PROFILE_COMPILE.value, changes=variants, documents=_DOCUMENTS.value,
      on_row=lambda rows: harness.write_json(_OUT.value, rows), hlo_dir=_HLO_DIR.value)
  print(benchmark.format_table(rows), flush=True)
  if failed:
    raise SystemExit(f"failed variants: {failed}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
