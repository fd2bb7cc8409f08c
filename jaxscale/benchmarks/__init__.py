"""The benchmark suite (`python -m jaxscale.bench`), as library code so an installed wheel runs it too.

Modules: `machine` (CPU model and flags, load gate), `threads` (intra-op threads per process, set and read
back), `stats` (Zipf ids, timing spread, per-round ratios), `sessions` (the worker protocol: each engine
timed alone in its own processes), `one_device`, `equal_devices`, `stages` (the parts, each also the worker
its sessions run as `python -m jaxscale.benchmarks.<part>`), `torchrec_runner` (the TorchRec baseline; torch
only inside its own processes), `report` (Markdown from the recorded JSON) and `suite` (the CLI).
Nothing here is imported by the rest of the library, and importing a module imports neither JAX nor torch.
"""
