"""The benchmarks' libraries: what each `experiments/bench_*.py` script measures and how (the scripts only parse
flags and print): `kda` (our KDA kernels and FLA's, timed alike), `moe` (the MoE layer and its grouped GEMMs),
`generate` (prefill and decode of the hybrid and all-MLA models), `mla_decode` (the MLA decode kernel)."""
