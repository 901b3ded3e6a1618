"""The runners: what runs a step's forward on a device (the engine's `runner.run`).

The Triton backend, split by concern: `triton_options` (TritonOptions, what `EngineConfig.triton`
carries), `triton_runner` (TritonRunner: construction, the RunnerInfo answers, the KV pool and
the per-row tables, `run`), `triton_layers` (the layer loop: every launch of one forward) and
`triton_graphs` (CUDA graphs per row bucket, the device-fed greedy tokens, run-ahead). The torch
reference runner is `workbench/runner.py`. Nothing is imported here, so that importing the
options does not import torch or triton.
"""
