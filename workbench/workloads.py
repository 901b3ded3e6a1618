"""Prompt sets for speculative decoding (issue 21's workloads), each with its generator.

    prompts = generate("code-edit", 32, seed=0)     # or load("code-edit") for the shipped set
    text = render(prompts[0])                       # Gemma 3 chat text, ending in the model turn

* code-edit: a synthetic Python function and "rewrite it with one change": the answer copies
  most of the prompt, where prompt lookup should pay most.
* agentic: a multi-turn JSON tool-call loop with repeated schemas and keys.
* extraction: synthetic records and "list verbatim the ones that match": the answer quotes the
  prompt.
* essay: a short essay on a topic: little repeats (the guard's case).

Everything is built from small vocabularies and templates written here, by a seeded
`random.Random`, so a set is a function of (workload, num, seed). The shipped sets
(`data/workloads/<workload>.jsonl`, 32 prompts each, seed 0) are `write()`'s output:

    python -m workbench.workloads [--data-dir data] [--num 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import WorkbenchError

__all__ = ["WORKLOADS", "WorkloadPrompt", "generate", "load", "render", "write"]

WORKLOADS = ("code-edit", "agentic", "extraction", "essay")


@dataclass(frozen=True)
class WorkloadPrompt:
    workload: str
    index: int
    messages: tuple[tuple[str, str], ...]  # (role, text): "user" or "model" turns, the last a user's
    max_tokens: int  # a suggestion: about what a full answer takes
    lead: str = ""  # the answer's first words, written for the model (a base model needs them)

    def to_json(self) -> dict:
        return {"workload": self.workload, "index": self.index, "messages": [list(m) for m in self.messages],
                "max_tokens": self.max_tokens, "lead": self.lead}

    @classmethod
    def from_json(cls, d: dict) -> "WorkloadPrompt":
        return cls(d["workload"], int(d["index"]), tuple((r, t) for r, t in d["messages"]), int(d["max_tokens"]),
                   d.get("lead", ""))


FORMATS = ("completion", "chat")


def render(p: WorkloadPrompt, form: str = "completion") -> str:
    """The prompt's text. "completion": the turns as plain paragraphs, then the lead: for a base
    model, such as the default Gemma 3 270M (a pretrained checkpoint: given chat turns it echoes
    the user's turn over and over). "chat": Gemma 3's chat turns, the model's turn opened with
    the lead, for an instruction-tuned model."""
    if form not in FORMATS:
        raise WorkbenchError(f"form={form!r} is not allowed: allowed {', '.join(FORMATS)}")
    if form == "completion":
        return "\n\n".join(text for _, text in p.messages) + "\n\n" + p.lead
    out = [f"<start_of_turn>{role}\n{text}<end_of_turn>\n" for role, text in p.messages]
    return "".join(out) + "<start_of_turn>model\n" + p.lead


def _check(workload: str) -> None:
    if workload not in WORKLOADS:
        raise WorkbenchError(f"unknown workload {workload!r}: allowed {', '.join(WORKLOADS)}")


def generate(workload: str, num: int, seed: int = 0) -> list[WorkloadPrompt]:
    _check(workload)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise WorkbenchError(f"num={num!r} is out of range: allowed an integer >= 1")
    make = {"code-edit": _code_edit, "agentic": _agentic, "extraction": _extraction, "essay": _essay}[workload]
    return [make(random.Random(f"{workload}-{seed}-{i}"), i) for i in range(num)]


def path(workload: str, data_dir: str | Path = "data") -> Path:
    return Path(data_dir) / "workloads" / f"{workload}.jsonl"


def load(workload: str, data_dir: str | Path = "data") -> list[WorkloadPrompt]:
    _check(workload)
    f = path(workload, data_dir)
    if not f.is_file():
        raise WorkbenchError(f"{f} is missing: `python -m workbench.workloads --data-dir {data_dir}` writes it")
    return [WorkloadPrompt.from_json(json.loads(line)) for line in f.read_text().splitlines() if line.strip()]


def write(data_dir: str | Path = "data", num: int = 32, seed: int = 0) -> list[Path]:
    from .atomic import atomic_write_text

    out = []
    for w in WORKLOADS:
        text = "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in generate(w, num, seed))
        f = path(w, data_dir)
        f.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, text)
        out.append(f)
    return out


# ---- code-edit ---------------------------------------------------------------------------------

_NOUNS = ["total", "count", "value", "offset", "score", "width", "height", "limit", "index", "weight", "price",
          "amount", "level", "step", "delta", "ratio", "size", "depth", "speed", "budget"]
_VERBS = ["compute", "update", "scale", "merge", "filter", "collect", "normalize", "measure", "balance", "rank"]
_THINGS = ["orders", "samples", "readings", "tiles", "pages", "rows", "events", "prices", "scores", "packets"]


def _function(rnd: random.Random) -> tuple[str, list[str], list[int]]:
    """A function's source, its variable names and the constants it uses."""
    names = rnd.sample(_NOUNS, 6)
    args = names[:3]
    acc, item, tmp = names[3], names[4], names[5]
    things = rnd.choice(_THINGS)
    consts = [rnd.randrange(2, 97) for _ in range(4)]
    lines = [f"def {rnd.choice(_VERBS)}_{things}({', '.join(args)}, {things}):",
             f'    """Return the {acc} of the {things}, scaled by {args[0]} and capped at {args[1]}."""',
             f"    {acc} = 0",
             f"    {tmp} = {args[2]} * {consts[0]}"]
    for _ in range(rnd.randrange(2, 5)):
        op = rnd.choice(["+", "-", "*"])
        lines += [f"    for {item} in {things}:",
                  f"        if {item} > {args[1]}:",
                  f"            {acc} = {acc} {op} {item} // {consts[1]}",
                  f"        elif {item} < {tmp}:",
                  f"            {acc} = {acc} + {tmp} - {item}",
                  "        else:",
                  f"            {acc} += {item} * {args[0]}",
                  f"    {tmp} = ({tmp} + {acc}) % {consts[2]}"]
    lines += [f"    if {acc} > {args[1]} * {consts[3]}:",
              f"        {acc} = {args[1]} * {consts[3]}",
              f"    return {acc} + {tmp}"]
    return "\n".join(lines), [acc, item, tmp] + args, consts


def _code_edit(rnd: random.Random, i: int) -> WorkloadPrompt:
    src, names, consts = _function(rnd)
    kind = rnd.choice(["rename", "constant"])
    if kind == "rename":
        old = rnd.choice(names[:3])
        new = old + "_" + rnd.choice(["new", "acc", "sum", "val"])
        change = f"rename the variable `{old}` to `{new}`"
    else:
        old = rnd.choice(consts)
        change = f"change the constant {old} to {old + rnd.randrange(1, 9)}"
    text = (f"Rewrite this Python function with one change: {change}. Keep everything else exactly as it is. "
            f"Reply with the whole function only.\n\n```python\n{src}\n```")
    lead = f"The function with that change ({change}):\n\n```python\n"
    return WorkloadPrompt("code-edit", i, (("user", text),), min(512, len(src) // 3 + 32), lead)


# ---- agentic -----------------------------------------------------------------------------------

_CITIES = ["Porto", "Lyon", "Tartu", "Graz", "Malmo", "Cork", "Bergen", "Ghent", "Turin", "Brno", "Split", "Kaunas"]
_PEOPLE = ["Ana Ruiz", "Ben Okafor", "Chen Wei", "Dara Flynn", "Eva Novak", "Farid Haddad", "Greta Lind",
           "Hugo Marin", "Ines Costa", "Jonas Berg", "Kira Sato", "Liam Walsh"]
_STATUS = ["shipped", "pending", "cancelled", "delivered", "returned"]

_TOOLS = [
    ("get_weather", {"city": "string", "day": "string"}),
    ("search_orders", {"customer": "string", "status": "string"}),
    ("convert_currency", {"amount": "number", "from": "string", "to": "string"}),
    ("book_table", {"restaurant": "string", "city": "string", "people": "integer"}),
]


def _args(rnd: random.Random, schema: dict) -> dict:
    out = {}
    for k, t in schema.items():
        if t == "number":
            out[k] = round(rnd.uniform(5, 500), 2)
        elif t == "integer":
            out[k] = rnd.randrange(1, 9)
        elif k in ("city",):
            out[k] = rnd.choice(_CITIES)
        elif k == "customer":
            out[k] = rnd.choice(_PEOPLE)
        elif k == "status":
            out[k] = rnd.choice(_STATUS)
        elif k in ("from", "to"):
            out[k] = rnd.choice(["EUR", "USD", "GBP", "SEK", "CHF"])
        elif k == "day":
            out[k] = rnd.choice(["today", "tomorrow", "monday", "friday"])
        else:
            out[k] = rnd.choice(["Casa Azul", "The Copper Pot", "Nordlys", "Olive Tree"])
    return out


def _result(rnd: random.Random, tool: str, args: dict) -> dict:
    if tool == "get_weather":
        return {"city": args["city"], "day": args["day"], "temp_c": rnd.randrange(-5, 32),
                "sky": rnd.choice(["clear", "cloudy", "rain", "snow"])}
    if tool == "search_orders":
        return {"orders": [{"id": rnd.randrange(1000, 9999), "status": args["status"],
                            "total": round(rnd.uniform(10, 400), 2)} for _ in range(rnd.randrange(1, 4))]}
    if tool == "convert_currency":
        return {"amount": round(args["amount"] * rnd.uniform(0.5, 1.5), 2), "currency": args["to"]}
    return {"confirmed": rnd.random() > 0.2, "time": f"{rnd.randrange(17, 22)}:{rnd.choice(['00', '30'])}"}


def _agentic(rnd: random.Random, i: int) -> WorkloadPrompt:
    tools = rnd.sample(_TOOLS, 3)
    spec = "\n".join(json.dumps({"name": n, "parameters": {k: {"type": t} for k, t in s.items()}}) for n, s in tools)
    system = ("You are an assistant that acts only through tools. Reply to each message with exactly one tool call "
              'as JSON: {"tool": <name>, "arguments": {...}}. The tools:\n' + spec)
    task = rnd.choice(["Plan an evening out for a customer and check the orders they placed.",
                       "Check the weather where the customer lives and convert the refund they are owed.",
                       "Find the customer's pending orders, then book a table for them."])
    msgs = [("user", f"{system}\n\nTask: {task}")]
    for _ in range(rnd.randrange(2, 5)):
        name, schema = rnd.choice(tools)
        args = _args(rnd, schema)
        msgs.append(("model", json.dumps({"tool": name, "arguments": args})))
        msgs.append(("user", "Tool result: " + json.dumps(_result(rnd, name, args)) + "\nNext tool call?"))
    return WorkloadPrompt("agentic", i, tuple(msgs), 96, '{"tool": "')


# ---- extraction ---------------------------------------------------------------------------------

def _extraction(rnd: random.Random, i: int) -> WorkloadPrompt:
    records = []
    for _ in range(rnd.randrange(20, 61)):
        records.append(f"Order {rnd.randrange(1000, 9999)}: customer {rnd.choice(_PEOPLE)}, city {rnd.choice(_CITIES)}, "
                       f"total {rnd.uniform(5, 900):.2f} EUR, status {rnd.choice(_STATUS)}.")
    if rnd.random() < 0.5:
        city = rnd.choice([r.split("city ")[1].split(",")[0] for r in records])
        cond, head = f"whose city is {city}", f"Orders in {city}"
    else:
        status = rnd.choice([r.split("status ")[1].rstrip(".") for r in records])
        cond, head = f"whose status is {status}", f"Orders with status {status}"
    text = ("Here are the orders of the week, one per line:\n\n" + "\n".join(records) +
            f"\n\nList, verbatim and one per line, every order {cond}. Copy each line exactly; add nothing else.")
    return WorkloadPrompt("extraction", i, (("user", text),), 256, f"{head}:\n\nOrder ")


# ---- essay --------------------------------------------------------------------------------------

_TOPICS = ["the first lighthouse keepers", "why rivers meander", "learning a second language as an adult",
           "the economics of a small bakery", "how bees decide where to live", "the history of the bicycle",
           "night trains across Europe", "what makes a good map", "the life of a glacier", "keeping a garden in a city",
           "the invention of the printing press", "why cats sleep so much", "building a stone wall by hand",
           "the sound of old radios", "how a violin is made", "the quiet work of librarians"]


def _essay(rnd: random.Random, i: int) -> WorkloadPrompt:
    topic = rnd.choice(_TOPICS)
    style = rnd.choice(["", " Use three paragraphs.", " Write it for a curious teenager.", " Keep it under 200 words."])
    lead = f"{topic[0].upper()}{topic[1:]}\n\n"
    return WorkloadPrompt("essay", i, (("user", f"Write a short essay about {topic}.{style}"),), 256, lead)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write the shipped workload prompt sets (data/workloads/*.jsonl)")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        for f in write(args.data_dir, args.num, args.seed):
            print(f)
    except WorkbenchError as e:
        print(f"workloads: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
