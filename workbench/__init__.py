"""Slotlab workbench: exact concurrent LLM serving, measured.

    import workbench
    m = workbench.load_model()                 # embedded Gemma 3 270M Q4_K_M
    ids = m.tokenize("text"); logits = m.logits(ids); text = m.detokenize(ids)
    engine = workbench.Engine(m, workbench.EngineConfig(max_concurrency=4))
    results = engine.generate(["a", "b"], max_tokens=32)

Attributes load lazily so that `import workbench` stays cheap (no torch until needed).
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": ("workbench.model", "load_model"),
    "Model": ("workbench.model", "Model"),
    "Engine": ("workbench.engine", "Engine"),
    "EngineConfig": ("workbench.engine_config", "EngineConfig"),
    "QSAConfig": ("workbench.qsa", "QSAConfig"),
    "SpecConfig": ("workbench.spec.config", "SpecConfig"),
    "GenerationResult": ("workbench.engine", "GenerationResult"),
    "SamplingParams": ("workbench.sampling", "SamplingParams"),
    "WorkbenchError": ("workbench.errors", "WorkbenchError"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
