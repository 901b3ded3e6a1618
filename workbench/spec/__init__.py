"""Speculative decoding across slots, exact: proposers, verification, the yield guard.

`SpecConfig` (config.py) is what the engine carries; `speculator.Speculator` is the engine-side
state (one proposer, one guard, each request's counters) and `verify` holds the acceptance
rules. This package's top level imports no torch (EngineConfig, hence the scheduler, imports
it); verify.py and speculator.py do, and are imported from their modules.
"""

from .config import MAX_K, PROPOSERS, VERIFIES, SpecConfig, proposer_fields, spec_config
from .guard import DraftCost, StepCost, YieldGuard
from .proposers import NgramProposer, Proposer, SuffixProposer, make_proposer

__all__ = ["DraftCost", "MAX_K", "NgramProposer", "PROPOSERS", "Proposer", "SpecConfig", "StepCost", "SuffixProposer",
           "VERIFIES", "YieldGuard", "make_proposer", "proposer_fields", "spec_config"]
