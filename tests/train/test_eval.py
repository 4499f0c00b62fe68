"""Evaluation: task rows (one example per row, weights on the answers), the default lengths, the aggregation of
held-out loss and accuracy, and the printed table. (A trained checkpoint is evaluated in test_train_loop.py.)"""
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments.configs import common
from k3jax.data import pipeline, tasks
from k3jax.data import tokenizer as tok
from k3jax import parallel
from k3jax.train import evaluate


def test_task_rows_hold_one_example_each_and_weigh_its_answers():
  rows = evaluate.task_rows("mqar", 3, 4, 7, 80)
  assert rows["tokens"].shape == (3, 80)
  for i, r in enumerate(range(4, 7)):
    ex = tasks.make_example("mqar", 3, r, 80)
    np.testing.assert_array_equal(rows["tokens"][i, :len(ex.tokens)], ex.tokens)
    np.testing.assert_array_equal(rows["weights"][i, :len(ex.tokens) - 1], ex.answer_mask[1:])
    np.testing.assert_array_equal(rows["targets"][i][rows["weights"][i] > 0], ex.tokens[ex.answer_mask])


def test_default_lengths_reach_four_times_the_training_length():
  c = common.base_config()
  assert evaluate.eval_lengths(c, 128) == (128, 256, 512)
  c.eval.lengths = (64, 1024)
  assert evaluate.eval_lengths(c, 128) == (64, 1024)


def _config(tmp_path):
  c = common.base_config()
  c.model = ml_collections.ConfigDict({"vocab_size": tok.VOCAB_SIZE})
  c.data.cache_dir = str(tmp_path)
  c.eval.batches, c.eval.batch_size, c.eval.examples = 2, 8, 16
  c.eval.tasks, c.eval.lengths = ("palindrome", "stack"), (32, 64)
  return c


def test_evaluate_sums_over_batches_and_reports_every_task_and_length(tmp_path):
  """With a scorer that calls every even row right, loss and accuracy must come out as the weighted means."""
  def scorer(state, batch):
    w = batch["weights"]
    right = w * (jnp.arange(w.shape[0]) % 2 == 0)[:, None]
    return {"ce_sum": 2.0 * jnp.sum(w), "correct": jnp.sum(right), "weight": jnp.sum(w)}

  c = _config(tmp_path)
  result = evaluate.evaluate(scorer, None, c, 64, parallel.mesh_from_string("data:2,expert:1"))
  assert result["heldout_loss"] == pytest.approx(2.0) and result["heldout_tokens"] > 0
  assert set(result["accuracy"]) == {"palindrome@32", "palindrome@64", "stack@32", "stack@64"}
  rows = evaluate.task_rows("palindrome", pipeline.derive_seed(0, 0, "tasks"), 0, 16, 32)["weights"]
  assert result["accuracy"]["palindrome@32"] == pytest.approx(rows[::2].sum() / rows.sum())
  assert result["chance"] == {"palindrome": 1 / 26, "stack": 1 / 26}
  table = evaluate.format_table(result, 32)
  assert "palindrome        64" in table and "(trained at 32)" in table and "held-out loss 2.0000" in table


def test_evaluate_rejects_batches_that_do_not_split(tmp_path):
  c = _config(tmp_path)
  c.eval.examples = 12
  with pytest.raises(ValueError, match="must divide"):
    evaluate.evaluate(None, None, c, 64, parallel.mesh_from_string("data:2,expert:1"))
