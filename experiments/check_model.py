"""GPU check of the model at a research config: bf16 fast paths against references, then timings, in one call.

  python -m experiments.check_model --config=small --batch=2 --seq_len=4096

Checks: the KDA and MLA layers in bf16 against their XLA paths in fp32 (packed documents), the whole model's prefill
and decode logits against its full forward in fp32 and in bf16, greedy generation against the full forward's
argmax; times: forward, forward+backward, prefill + decode. What each check compares: `experiments/model_check.py`.
Writes $OUT/check_model.json when $OUT is set; exits non-zero when a check is past its tolerance.
"""
import os

from absl import app, flags

from experiments import configs, harness, model_check

_CONFIG = flags.DEFINE_string("config", "small", "config name under experiments/configs/, or a .py path")
_BATCH = flags.DEFINE_integer("batch", 2, "sequences per step")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "tokens per sequence")
_DECODE = flags.DEFINE_integer("decode_tokens", 64, "tokens generated after a prompt of seq_len/2 in the timing")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repetitions (median)")
_OUT = flags.DEFINE_string("out", os.path.join(os.environ["OUT"], "check_model.json") if os.environ.get("OUT")
                           else "", "JSON file for the results")


def main(argv):
  harness.check_argv(argv)
  sizes = model_check.Sizes(batch=_BATCH.value, seq_len=_SEQ_LEN.value, decode_tokens=_DECODE.value,
                            repeats=_REPEATS.value)
  results = {"config": _CONFIG.value, **model_check.run(configs.load(_CONFIG.value).model, sizes)}
  print(model_check.format_report(results, _CONFIG.value))
  harness.write_json(_OUT.value, results)
  if failed := model_check.failed_checks(results):
    raise SystemExit(f"checks past their tolerance: {failed}")


if __name__ == "__main__":
  app.run(main)
