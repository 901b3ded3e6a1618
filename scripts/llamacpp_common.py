"""Opening llama.cpp (llama-cpp-python, built from its sdist) the way this project's scripts need.

llama.cpp built from that sdist crashes on this CPU for multi-token batches unless weight
repacking is off. `Llama()` builds its model params from `llama_model_default_params()` and has
no keyword for `use_extra_bufts`, so the default is wrapped for the duration of the load.
"""

from __future__ import annotations


def open_llama(path: str, **kwargs):
    """A `llama_cpp.Llama` for `path` with weight repacking off; kwargs go to `Llama()`."""
    import llama_cpp
    import llama_cpp.llama_cpp as lowlevel  # the module llama.py calls for its defaults

    real_default = lowlevel.llama_model_default_params

    def default_params_without_repack():
        p = real_default()
        p.use_extra_bufts = False
        return p

    lowlevel.llama_model_default_params = default_params_without_repack
    try:
        llm = llama_cpp.Llama(model_path=path, verbose=False, **kwargs)
    finally:
        lowlevel.llama_model_default_params = real_default
    assert llm.model_params.use_extra_bufts is False
    return llm
