"""Draft proposers: each keeps its own state per request, behind one small interface.

    p = make_proposer(SpecConfig(proposer="ngram"))
    p.start(rid, prompt_ids)
    draft = p.propose(rid, context_ids, k)     # at most k tokens, maybe none
    p.finish(rid, context_ids, num_prompt)     # the request is done (suffix: learn its output)
    paths = p.propose_tree(rid, context_ids, k, budget)   # optional: token trees (SpecConfig.tree)

A proposal is only a guess: verification (verify.py) keeps the output exact whatever comes
back, so a proposer is judged by its yield alone. Plain Python, no torch: the model-based
proposers (model_proposer.py: the target's first layers, a draft GGUF; an MTP head later)
implement the same four methods, and may add `propose_many({rid: (context, k)})`, which the
speculator then calls once a step for all requests (a model drafts them in one batch).

Token trees (`SpecConfig.tree`): a proposer may add `propose_tree(rid, context, k, budget)`,
the tree as its root-to-leaf paths, the main draft (`propose`'s) first, each at most k tokens,
together at most `budget` tokens, none a prefix of another (`tree_paths` keeps them so). A
proposer without it drafts a chain. The n-gram proposer's alternatives are the continuations
of the matched suffix's earlier occurrences, latest first; the suffix proposer's branch at the
first token, the next most frequent continuations, each then followed greedily.

* `NgramProposer` (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding): the
  longest suffix of the context, ngram_max tokens down to ngram_min, that occurred earlier in
  the context; the tokens that followed its latest earlier occurrence are the draft. Written
  here, not taken from a library: the context is kept as packed token ids and each suffix is
  found with a byte search (`_Tokens`), so keeping it costs a copy of the new tokens a step.
* `SuffixProposer` (after SuffixDecoding, Oliaro et al. 2024): counts of what followed each
  context of up to `suffix_depth` tokens, in the request's own prompt and output and across
  the outputs of the requests that finished before it; the draft follows the most frequent
  continuation of the longest matched suffix, token by token. (A count table per context
  length rather than a suffix tree: the same proposals for contexts up to the depth, and a
  dict lookup a step.)
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from typing import Hashable, Protocol, Sequence

from .config import SpecConfig

__all__ = ["NgramProposer", "Proposer", "SuffixProposer", "make_proposer", "tree_paths"]


class Proposer(Protocol):
    name: str

    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, rid: Hashable, context: Sequence[int], k: int) -> tuple[int, ...]: ...

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> None: ...


def make_proposer(config: SpecConfig, model=None, runner=None) -> Proposer:
    """The config's proposer; "self" and "draft" run a draft model beside the target `model`
    and its `runner` (model_proposer.py), so they need both."""
    if config.proposer in ("self", "draft"):
        if model is None or runner is None:
            from ..errors import WorkbenchError

            raise WorkbenchError(f"proposer={config.proposer!r} drafts with a model: allowed only with the "
                                 f"target model and runner given (an Engine builds it)")
        from .model_proposer import build_model_proposer

        return build_model_proposer(config, model, runner)
    if config.proposer == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min, tree=config.tree is not None)
    return SuffixProposer(config.suffix_depth, config.ngram_min)


def tree_paths(candidates, k: int, budget: int, most: int) -> tuple[tuple[int, ...], ...]:
    """A tree's paths from candidate continuations in order of preference: each cut to k tokens,
    empty ones and those a kept path already starts with (they would verify nothing new) passed
    over, at most `most` paths and `budget` tokens in all (the last one cut to fit)."""
    out: list[tuple[int, ...]] = []
    left = budget
    for c in candidates:
        c = tuple(c[: min(k, left)])
        if not c or any(p[: len(c)] == c for p in out):
            continue
        out.append(c)
        left -= len(c)
        if left <= 0 or len(out) >= most:
            break
    return tuple(out)


class _Tokens:
    """One request's context as packed 32-bit token ids, extended as it grows: the n-gram
    lookups are byte searches over it (bytes.rfind, in C), so keeping it costs a copy of the new
    tokens a call, and a lookup about a microsecond per thousand tokens. (A hash map per suffix
    length, kept a token at a time in Python, cost 2-4 us a token: at 16 slots held at k = 0,
    shadow drafts kept it up to date at 0.16 ms a step, essays 0.8x of AR, H100 run 96.)"""

    def __init__(self, prompt_ids: Sequence[int]):
        self.ids = array("i", prompt_ids)
        self.width = self.ids.itemsize

    def sync(self, context: Sequence[int]) -> bytes:
        """The packed context (its tokens appended since the last call; a shorter context, as
        after a truncation, cuts them)."""
        ids, L = self.ids, len(context)
        if len(ids) > L:
            del ids[L:]
        elif len(ids) < L:
            ids.extend(context[len(ids) :])
        return ids.tobytes()

    def ends(self, data: bytes, n: int, end: int):
        """The ends j <= `end` of the earlier occurrences of the context's last n tokens (in
        `data`, the packed context), latest first."""
        w = self.width
        pat = data[len(data) - n * w :]
        hi = end * w
        while True:
            i = data.rfind(pat, 0, hi)
            if i < 0:
                return
            if i % w == 0:  # (a match across token boundaries is no match)
                yield i // w + n
            hi = i + len(pat) - 1  # (matches starting before i)


class NgramProposer:
    name = "ngram"
    # its drafts cost host lookups only: the speculator may draft in the shadow of plain steps,
    # to measure acceptance without verifying (speculator.py)
    shadows = True

    def __init__(self, n_max: int = 4, n_min: int = 2, tree: bool = False):
        self.n_max, self.n_min, self.tree = n_max, n_min, tree
        self.sizes = range(n_max, n_min - 1, -1)
        self._tokens: dict[Hashable, _Tokens] = {}

    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        self._tokens[rid] = _Tokens(prompt_ids)

    def propose(self, rid: Hashable, context: Sequence[int], k: int) -> tuple[int, ...]:
        toks = self._tokens[rid]
        data, L = toks.sync(context), len(context)
        for n in self.sizes:
            if n < L:
                for j in toks.ends(data, n, L - 1):  # (not the end L itself: that is the suffix looked up)
                    return tuple(context[j : j + k])
        return ()

    def propose_tree(self, rid: Hashable, context: Sequence[int], k: int, budget: int,
                     most: int = 8) -> tuple[tuple[int, ...], ...]:
        """The main draft, then what followed the longest matched suffix's earlier occurrences,
        latest first, then shorter suffixes'."""
        main = self.propose(rid, context, k)
        toks, L = self._tokens[rid], len(context)
        data = toks.ids.tobytes()

        def candidates():
            yield main
            for n in self.sizes:
                if n < L:
                    for j in toks.ends(data, n, L - 1):
                        yield context[j : j + k]

        return tree_paths(candidates(), k, budget, most) if main else ()

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> None:
        self._tokens.pop(rid, None)


class _Counts:
    """n -> {context of n tokens: {next token: count}} over the token runs added."""

    def __init__(self, depth: int):
        self.depth = depth
        self.table: dict[int, dict[tuple[int, ...], dict[int, int]]] = {n: defaultdict(dict) for n in range(1, depth + 1)}

    def add(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Count the tokens at positions start..end-1 after their contexts within `tokens`."""
        for j in range(max(start, 1), end):
            nxt = tokens[j]
            for n in range(1, min(self.depth, j) + 1):
                row = self.table[n][tuple(tokens[j - n : j])]
                row[nxt] = row.get(nxt, 0) + 1

    def get(self, suffix: tuple[int, ...]) -> dict[int, int] | None:
        return self.table[len(suffix)].get(suffix)


class SuffixProposer:
    name = "suffix"
    shadows = True  # (as NgramProposer's)

    def __init__(self, depth: int = 8, min_match: int = 2):
        self.depth, self.min_match = depth, min_match
        self.corpus = _Counts(depth)  # the finished requests' outputs
        self._local: dict[Hashable, tuple[_Counts, list[int]]] = {}  # rid -> (its counts, tokens added)

    def start(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        local = _Counts(self.depth)  # (the prompt counted at submission: NgramProposer.start says why)
        local.add(prompt_ids, 0, len(prompt_ids))
        self._local[rid] = (local, [len(prompt_ids)])

    def propose(self, rid: Hashable, context: Sequence[int], k: int) -> tuple[int, ...]:
        local, done = self._local[rid]
        local.add(context, done[0], len(context))
        done[0] = len(context)
        return tuple(self._follow(local, [], list(context[-self.depth :]), k))

    def _follow(self, local: _Counts, path: list[int], tail: list[int], k: int) -> list[int]:
        """`path` extended, up to k tokens, by the most frequent next token after `tail` (the
        context's last tokens, then the path's), token by token."""
        while len(path) < k:
            nxt = self._next(local, tail)
            if nxt is None:
                break
            path.append(nxt)
            tail = (tail + [nxt])[-self.depth :]
        return path

    def propose_tree(self, rid: Hashable, context: Sequence[int], k: int, budget: int,
                     most: int = 8) -> tuple[tuple[int, ...], ...]:
        """The main draft, then, at each of its positions from the first, a path for each
        other next token seen after the context there (the longest matched suffix's, most
        frequent first, then shorter suffixes'), each continued greedily: a tree branching
        along the main draft."""
        main = self.propose(rid, context, k)
        if not main:
            return ()
        local, _ = self._local[rid]
        tail = list(context[-self.depth :])

        def candidates():
            yield main
            for i in range(len(main)):
                t = (tail + list(main[:i]))[-self.depth :]
                seen = [main[i]]
                for n in range(min(self.depth, len(t)), self.min_match - 1, -1):
                    for alt in self._ranked(local, t[-n:]):
                        if alt not in seen:
                            seen.append(alt)
                            yield self._follow(local, list(main[:i]) + [alt], (t + [alt])[-self.depth :], k)

        return tree_paths(candidates(), k, budget, most)

    def _ranked(self, local: _Counts, tail: list[int]) -> list[int]:
        """The next tokens after the longest suffix of `tail` seen (local and corpus counts
        together), most frequent first, ties to the lower token id: deterministic."""
        for n in range(min(self.depth, len(tail)), self.min_match - 1, -1):
            suffix = tuple(tail[-n:])
            rows = [r for r in (local.get(suffix), self.corpus.get(suffix)) if r]
            if rows:
                counts: dict[int, int] = {}
                for r in rows:
                    for t, c in r.items():
                        counts[t] = counts.get(t, 0) + c
                return sorted(counts, key=lambda t: (-counts[t], t))
        return []

    def _next(self, local: _Counts, tail: list[int]) -> int | None:
        """The most frequent next token after the longest suffix of `tail` seen."""
        ranked = self._ranked(local, tail)
        return ranked[0] if ranked else None

    def finish(self, rid: Hashable, context: Sequence[int], num_prompt: int) -> None:
        self._local.pop(rid, None)
        self.corpus.add(context, num_prompt, len(context))  # its output, after its own context
