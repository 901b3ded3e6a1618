"""PageAllocator under random interleavings (hypothesis stateful), against a fake device.

The fake device holds each page's positions as token ids ("KV"). Each step's writes and
copies go to a FIFO and land when the step retires, as a launched step's do; the engine's
commits come with them. After every rule: `PageAllocator.check()` (free + used + cached +
quarantined == total, refcounts == block-table holders, no page held twice, holes only
where no query looks), and, with the FIFO drained, every position a sequence can still see
reads back its own token, and every hashed page holds the tokens its hash names. A page
handed out while a step could still write it, or written while shared, shows up as a wrong
token.
"""

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from workbench.errors import WorkbenchError
from workbench.state import KVGroup, PageAllocator, PageCopy, StateLayout, cache_key

P, WINDOW, MAX_APPEND = 4, 6, 9
BASE = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 3, 3, 1, 9, 2, 7, 7, 4, 0, 5, 8, 1, 6]
PROMPTS = [BASE, BASE[:13], BASE[:9] + [0, 0, 0, 0, 1, 1], BASE[:4] + BASE[:12], [5] * 10]


class AllocatorMachine(RuleBasedStateMachine):
    max_rollback = 0

    def __init__(self):
        super().__init__()
        self.layout = StateLayout(
            (KVGroup("global", (0, 2)), KVGroup("sliding", (1,), WINDOW)), page_size=P, key_blocks=(P,))
        self.a = PageAllocator(self.layout, {"global": 24, "sliding": 10}, cache_key=cache_key("m", "f32"),
                               max_rollback=self.max_rollback)
        self.kv = {g: {} for g in self.layout.group_names}  # group -> page -> {offset: token}
        self.content: dict[int, list[int]] = {}  # seq -> the token at each position < length
        self.todo: dict[int, list[int]] = {}  # seq -> prompt tokens not yet appended
        self.fifo: list[tuple[int, object]] = []  # (step, op) in launch order
        self.step = 0
        self.next_seq = 0
        self.named: dict[bytes, tuple[int, ...]] = {}  # hash -> the tokens of its page
        self.writers: dict[tuple[str, int], set] = {}  # (group, page) -> {(step, seq)} in flight

    # -- helpers -----------------------------------------------------------------------

    def fence(self):
        return self.fifo[-1][0] if self.fifo else None

    def pick(self, i):
        """The i-th sequence (modulo), None when there is none (the rule then does nothing)."""
        seqs = sorted(self.content)
        return seqs[i % len(seqs)] if seqs else None

    def launch(self, seq, ops):
        """Queue a step of `seq`. The steps of one sequence are ordered, but nothing orders a
        launched step against another sequence's work (a page-in on a copy stream, a host
        write), so no page a step of another sequence may still write can be written here."""
        self.step += 1
        for op in ops:
            if op[0] in ("copy", "write"):
                key = (op[1].group, op[1].dst) if op[0] == "copy" else (op[1], op[2])
                others = {owner for _, owner in self.writers.get(key, ()) if owner != seq}
                assert not others, f"page {key} handed to {seq} while a step of {others} may write it"
                self.writers.setdefault(key, set()).add((self.step, seq))
        self.fifo += [(self.step, op) for op in ops]
        return self.step

    def apply(self, op):
        kind = op[0]
        if kind == "copy":
            c: PageCopy = op[1]
            src, dst = self.kv[c.group].get(c.src, {}), self.kv[c.group].setdefault(c.dst, {})
            for off in range(c.num_positions):
                dst[off] = src.get(off)
        elif kind == "write":
            _, group, page, off, token = op
            self.kv[group].setdefault(page, {})[off] = token
        elif kind == "commit":
            _, seq, start, tokens = op
            if seq in self.content:
                s = self.a.sequence(seq)
                end = min(start + len(tokens), s.length)
                if s.num_committed == start and end > start:
                    self.a.commit(seq, tokens[: end - start])
                    for i, h in enumerate(s.hashes):
                        self.named.setdefault(h, tuple(s.token_ids[i * P : (i + 1) * P]))

    def cut(self, seq, new_len):
        """truncate in the model: the content, and the queued commits of positions >= new_len
        (the engine commits only what survives a rollback)."""
        self.a.truncate(seq, new_len, self.fence())
        del self.content[seq][new_len:]
        fifo = []
        for step, op in self.fifo:
            if op[0] == "commit" and op[1] == seq:
                op = op[:3] + (op[3][: max(0, new_len - op[2])],)
            fifo.append((step, op))
        self.fifo = fifo

    def grow(self, seq, tokens):
        """append + the step's writes (checked writable now) + its commit, all queued."""
        fence = self.fence()
        L = self.a.sequence(seq).length
        if not self.a.can_append(seq, len(tokens), fence):
            before = self.a.read_stats()
            with pytest.raises(WorkbenchError, match="cannot grow"):
                self.a.append(seq, len(tokens), fence)
            after = self.a.read_stats()
            assert [g.num_used for g in before.groups] == [g.num_used for g in after.groups]
            assert self.a.sequence(seq).length == L
            event("append refused")
            return False
        s = self.a.sequence(seq)
        before = {g: len(s.tables[g]) for g in self.layout.group_names}
        copies = self.a.append(seq, len(tokens), fence)
        ops = [("copy", c) for c in copies]
        if copies:
            event("copy-on-write")
        if any(p.num_quarantined for p in self.a.pools.values()):
            event("pages quarantined")
        for g in self.layout.groups:
            t = s.tables[g.name]
            pool = self.a.pools[g.name]
            lo = self.layout.first_live_page(g.name, s.floor)
            assert all(t[i] is None for i in range(min(lo, len(t)))), "a dead page was kept"
            bound = self.layout.max_live_pages(g.name, s.length, MAX_APPEND, self.max_rollback)
            assert len(t.pages()) <= bound
            # each page the append took continues the table's run when the page after the one
            # before it was free (nothing an append does frees that page after its allocation)
            free = {p for lo_, hi_ in pool.free_runs() for p in range(lo_, hi_)}
            fresh = set(range(before[g.name], len(t))) | {L // P for c in copies if c.group == g.name}
            for i in sorted(fresh):
                prev = t[i - 1] if i else None
                if prev is not None:
                    assert t[i] == prev + 1 or prev + 1 not in free, "the page after a sequence's last was free, not taken"
                    event("a page continues its run" if t[i] == prev + 1 else "a run breaks")
            for k, tok in enumerate(tokens):
                page, off = t.locate(L + k)
                assert pool.refcount[page] == 1 and not pool.is_read_only(page), "a write into a read-only page"
                ops.append(("write", g.name, page, off, tok))
        ops.append(("commit", seq, L, list(tokens)))
        self.launch(seq, ops)
        self.content[seq] += list(tokens)
        return True

    # -- rules -------------------------------------------------------------------------

    @rule(p=st.sampled_from(range(len(PROMPTS))), extra=st.lists(st.integers(0, 9), max_size=3))
    def add(self, p, extra):
        prompt = PROMPTS[p] + extra
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        m = self.a.match(prompt)
        assert m.num_tokens % P == 0 and m.num_tokens < len(prompt)
        for g in self.layout.group_names:  # a hit's pages hold the prompt's tokens
            for i, page in enumerate(m.pages.get(g, ())):
                if page is not None:
                    assert self.named[m.hashes[i]] == tuple(prompt[i * P : (i + 1) * P])
                    assert not self.writers.get((g, page)), "a hit on a page a launched step may write"
        assert self.a.add(seq, m) == m.num_tokens
        if m.num_tokens:
            event("prefix hit")
        self.content[seq] = list(prompt[: m.num_tokens])
        self.todo[seq] = list(prompt[m.num_tokens :])

    @rule(p=st.sampled_from(range(len(PROMPTS))), chunk=st.integers(1, MAX_APPEND))
    def serve(self, p, chunk):
        """A whole request: admit, prefill in chunks, let the steps land, finish. It leaves its
        prompt's full pages in the cache for later requests to hit."""
        self.add(p, [])
        seq = self.next_seq - 1
        while self.todo[seq]:
            if not self.grow(seq, self.todo[seq][:chunk]):
                break
            del self.todo[seq][:chunk]
        self.retire(True)
        self.a.check()
        self.free(sorted(self.content).index(seq))  # free() picks by index

    @rule(i=st.integers(0, 99), n=st.integers(1, MAX_APPEND), tok=st.integers(0, 9))
    def append(self, i, n, tok):
        seq = self.pick(i)
        if seq is None:
            return
        todo = self.todo[seq]
        tokens = todo[:n] if todo else [tok] * min(n, 3)
        if self.grow(seq, tokens):
            del todo[: len(tokens)]

    @rule(i=st.integers(0, 99), k=st.integers(1, 3), accepted=st.integers(0, 3), tok=st.integers(0, 9))
    def speculate(self, i, k, accepted, tok):
        """Verify k draft tokens, then roll back the rejected ones (the run-ahead fence)."""
        seq = self.pick(i)
        if seq is None or self.todo[seq]:
            return
        L = self.a.sequence(seq).length
        if self.grow(seq, [tok] * (k + 1)):
            self.cut(seq, L + min(accepted, k) + 1)

    @rule(i=st.integers(0, 99), back=st.integers(0, 12))
    def truncate(self, i, back):
        seq = self.pick(i)
        if seq is None:
            return
        s = self.a.sequence(seq)
        low = self.a.min_length(seq)
        new_len = max(low, s.length - back)
        if low > 0:
            with pytest.raises(WorkbenchError, match="out of range"):
                self.a.truncate(seq, low - 1)
        self.cut(seq, new_len)
        self.todo[seq] = []

    @rule(i=st.integers(0, 99), back=st.integers(1, 2 * P), tok=st.integers(0, 9))
    def rewrite(self, i, back, tok):
        """Let the steps land (their pages get hashed), roll back into them, write again:
        the write must go to a private copy of a cached or shared page."""
        self.retire(True)
        seq = self.pick(i)
        if seq is None:
            return
        self.cut(seq, max(self.a.min_length(seq), self.a.sequence(seq).length - back))
        self.todo[seq] = []
        self.grow(seq, [tok])

    @rule(i=st.integers(0, 99), back=st.integers(0, 6))
    def fork(self, i, back):
        parent = self.pick(i)
        if parent is None:
            return
        s = self.a.sequence(parent)
        n = max(self.a.min_length(parent), s.length - back)
        if not self.a.can_fork(parent, n):
            return
        child, self.next_seq = self.next_seq, self.next_seq + 1
        copies = self.a.fork(parent, child, n)
        event("fork with a copy" if copies else "fork")
        self.launch(child, [("copy", c) for c in copies])
        self.content[child] = self.content[parent][:n]
        self.todo[child] = []

    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self.pick(i)
        if seq is None:
            return
        held = {g: set(self.a.block_table(seq, g).pages()) for g in self.layout.group_names}
        self.a.free(seq, self.fence())
        del self.content[seq], self.todo[seq]
        for g, pages in held.items():  # it leaves no page behind
            others = {p for s in self.content for p in self.a.block_table(s, g).pages()}
            for p in pages - others:
                assert self.a.pools[g].refcount[p] == 0

    @rule(all_=st.booleans())
    def retire(self, all_):
        if not self.fifo:
            return
        upto = self.fifo[-1][0] if all_ else self.fifo[0][0]
        while self.fifo and self.fifo[0][0] <= upto:
            self.apply(self.fifo.pop(0)[1])
        self.a.retire(upto)
        for key in list(self.writers):
            self.writers[key] = {(step, owner) for step, owner in self.writers[key] if step > upto}

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def allocator_invariants(self):
        self.a.check()
        st_ = self.a.read_stats()
        for g in st_.groups:
            assert g.num_used + g.num_free + g.num_cached + g.num_quarantined == g.num_pages
        assert self.a.num_sequences == len(self.content)
        for seq, toks in self.content.items():
            assert self.a.sequence(seq).length == len(toks)

    @invariant()
    def device_reads_back(self):
        if self.fifo:
            return
        for seq, toks in self.content.items():
            s = self.a.sequence(seq)
            for g in self.layout.groups:
                lo = max(0, s.floor - g.window + 1) if g.sliding else 0
                t = s.tables[g.name]
                for pos in range(lo, s.length):
                    page, off = t.locate(pos)
                    assert self.kv[g.name][page].get(off) == toks[pos], (seq, g.name, pos)
        for g in self.layout.group_names:
            cache = self.a.pools[g].cache
            for h, tokens in self.named.items():
                page = cache.lookup(h)
                if page is not None:
                    assert tuple(self.kv[g][page].get(o) for o in range(P)) == tokens


class RollbackMachine(AllocatorMachine):
    max_rollback = 3


SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = SETTINGS
TestRollbackMachine = RollbackMachine.TestCase
TestRollbackMachine.settings = settings(SETTINGS, max_examples=30)
