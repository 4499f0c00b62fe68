"""The MLA decode benchmark's library (experiments/benchmarks/mla_decode.py): a row's GB/s counts the latents each
row reads once, an implementation that cannot run is a row (not the end), the table's speed-ups are against XLA at
the same shape, and unknown implementations are refused before any compute. The whole benchmark runs end to end in
tests/test_benchmarks.py."""
import pytest

from experiments.benchmarks import mla_decode as bench
from pallas_kernels.mla_decode import mla_decode_reference


def test_measure_checks_against_the_reference_and_counts_each_rows_latents_once():
  q, ckv, lengths = bench.inputs(3, 2, 16, 40, ragged=True)
  assert int(lengths.min()) >= 1 and int(lengths.max()) <= 40 and len(set(lengths.tolist())) > 1
  ref = mla_decode_reference(q, ckv, lengths, scale=0.5)
  row = bench.measure("xla", bench.implementations(0.5)["xla"], q, ckv, lengths, ref, repeats=1)
  assert row["ok"] and row["err"] < bench.CHECK_TOL
  seconds = row["us"] * 1e-6
  assert row["gb_per_s"] * 1e9 * seconds == pytest.approx(int(lengths.sum()) * 16 * 2)   # bf16 latents
  wrong = bench.measure("xla", bench.implementations(0.25)["xla"], q, ckv, lengths, ref, repeats=1)
  assert not wrong["ok"]                                                                 # another scale: caught


def test_measure_reports_an_implementation_that_cannot_run_as_a_row():
  def refuses(q, ckv, lengths):
    raise NotImplementedError("no such kernel here")
  q, ckv, lengths = bench.inputs(1, 2, 16, 8, ragged=False)
  assert bench.measure("pallas", refuses, q, ckv, lengths, None, repeats=1) == {
      "impl": "pallas", "error": "NotImplementedError: no such kernel here"}


def test_format_table_divides_xla_time_by_each_row_at_the_same_shape():
  rows = [{"B": 1, "L": 64, "ragged": False, "impl": "xla", "us": 30.0, "gb_per_s": 1.0, "err": 1e-3, "ok": True},
          {"B": 1, "L": 64, "ragged": False, "impl": "pallas", "us": 10.0, "gb_per_s": 3.0, "err": 2e-3, "ok": True},
          {"B": 1, "L": 64, "ragged": True, "impl": "pallas", "us": 10.0, "gb_per_s": 3.0, "err": 2e-3, "ok": True},
          {"B": 1, "L": 64, "ragged": False, "impl": "pallas", "us": 15.0, "gb_per_s": 2.0, "err": 2e-3, "ok": True,
           "config": "DecodeConfig(block_l=64)"},
          {"B": 1, "L": 64, "ragged": False, "impl": "jax_mqa", "error": "AssertionError: 64 % 16"}]
  lines = bench.format_table(rows).splitlines()
  assert lines[1].split()[-1] == "1.00x" and lines[2].split()[-1] == "3.00x"
  assert lines[3].endswith("2.0e-03  ")                   # no XLA row of that shape: no ratio
  assert lines[4].endswith("2.00x  DecodeConfig(block_l=64)") and lines[5].endswith("error: AssertionError: 64 % 16")
  assert bench.failed_rows(rows + [{"impl": "pallas", "error": "x"}]) == [{"impl": "pallas", "error": "x"}]


def test_run_refuses_an_unknown_implementation():
  with pytest.raises(ValueError, match="flashmla"):
    bench.run([8], [1], 2, 16, impls=["xla", "flashmla"], ragged=False, sweep=False, repeats=1)
