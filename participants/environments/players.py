"""How the scripted stand-in model plays each bundled environment.

The scripted policy (participants/model/backends/scripted.py) asks each registered environment's `scripted`
player, in `priority` order, whether it recognises the request, from what a model sees: the tool
names and the prompt text. An environment from outside brings its own player the same way (or none:
then the policy answers like the string player, the last resort). Every move is a pure function of
(prompt, history of tool calls, tools, seed): its mistakes come from hashes of its inputs, so a
replayed or resumed rollout gets byte-identical replies.
"""

from __future__ import annotations

import ast
import datetime as dt
import hashlib
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .arithmetic import evaluate

MATH_SLIP = 0.2
STRING_SLIP = 0.1
WORKPLACE_SLIP = 0.12
# The share of sandbox episodes that keep a watcher running in the background, as a coding agent keeps a
# dev server or a test watcher: no boundary of theirs has a snapshot, so they restart rather than continue.
SANDBOX_WATCHER = 0.25


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Step:
    """One finished tool call as the conversation shows it."""

    name: str
    arguments: dict[str, Any]
    result: Any


# -- plumbing --------------------------------------------------------------------


def _chance(seed: int, prompt: str, tag: str) -> float:
    """A number in [0, 1) fixed for one episode, so every turn agrees on whether to slip."""
    digest = hashlib.sha256(f"{seed}|{tag}|{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _history(messages: list[dict]) -> list[Step]:
    calls: dict[str, tuple[str, dict[str, Any]]] = {}
    steps: list[Step] = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {}
            calls[call.get("id", "")] = (fn.get("name", ""), args if isinstance(args, dict) else {})
        if m.get("role") == "tool" and m.get("tool_call_id") in calls:
            name, args = calls[m["tool_call_id"]]
            content = m.get("content")
            try:
                result = json.loads(content) if isinstance(content, str) else content
            except json.JSONDecodeError:
                result = {"text": content}
            steps.append(Step(name, args, result))
    return steps


def _transcript(messages: list[dict]) -> list[Step]:
    """Tool calls a harness wrote into the conversation as text (smolagents's tool-calling agent: an
    assistant's "Calling tools:" and a list, then a user's "Observation:"), as steps."""
    steps: list[Step] = []
    pending: list[tuple[str, dict[str, Any]]] = []
    for m in messages:
        text = text_of(m.get("content"))
        if m.get("role") == "assistant" and "Calling tools:" in text:
            try:
                calls = ast.literal_eval(text.split("Calling tools:", 1)[1].strip())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                calls = []
            pending = [(str(c["function"].get("name")), c["function"].get("arguments") or {}) for c in calls
                       if isinstance(c, dict) and isinstance(c.get("function"), dict)]
        elif m.get("role") == "user" and text.startswith("Observation:") and pending:
            name, args = pending.pop(0)
            steps.append(Step(name, args if isinstance(args, dict) else {}, {"text": text.removeprefix("Observation:").strip()}))
    return steps


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _find(history: list[Step], tool: str, /, **arguments: Any) -> Any:
    for step in reversed(history):
        if step.name == tool and all(step.arguments.get(k) == v for k, v in arguments.items()):
            return step.result
    return None


def _failed(result: Any) -> str | None:
    if isinstance(result, dict) and "error" in result:
        return f"I could not finish: {result.get('message') or result['error']}."
    return None


# -- blackjack -------------------------------------------------------------------


def _blackjack(history: list[Step]) -> Call | Answer:
    if not history:
        return Call("look", {})
    last = history[-1].result
    if not isinstance(last, dict) or "player_sum" not in last:
        return Answer(_failed(last) or "The hand is over.")
    if last.get("done"):
        dealer = f", the dealer had {last['dealer_sum']}" if "dealer_sum" in last else ""
        return Answer(f"The hand is over: I had {last['player_sum']}{dealer}. Reward: {last.get('reward')}.")
    # The textbook dealer-mimicking rule: good enough to win sometimes, far from optimal.
    return Call("hit" if last["player_sum"] < 17 else "stand", {})


# -- single-turn tasks ---------------------------------------------------------------


def _math(expression: str, chance: float) -> Answer:
    try:
        value = evaluate(expression)
    except (ValueError, SyntaxError):
        return Answer("I cannot work that out.")
    if chance < MATH_SLIP:
        # A plausible arithmetic slip: off by one or by ten.
        value += [-10, -1, 1, 10][int(chance / MATH_SLIP * 4)]
    return Answer(f"{expression.strip()} = {value}. The answer is {value}")


_STRING_OPS = [
    ("Reverse the string", lambda s: s[::-1]),
    ("Uppercase the string", str.upper),
    ("Lowercase the string", str.lower),
    ("Sort the characters of the string", lambda s: "".join(sorted(s))),
    ("Remove the vowels from the string", lambda s: "".join(c for c in s if c.lower() not in "aeiou")),
]


def _string(prompt: str, chance: float) -> Answer:
    for phrase, transform in _STRING_OPS:
        m = re.search(re.escape(phrase) + r" '(.*)'", prompt)
        if m:
            result = transform(m.group(1))
            # A slip drops the last character, the kind of off-by-one a model makes.
            return Answer(result[:-1] if chance < STRING_SLIP and len(result) > 1 else result)
    return Answer("I am not sure what to do.")


# -- sandbox -----------------------------------------------------------------------


def _sandbox(prompt: str, history: list[Step], watcher: bool = False) -> Call | Answer:
    """A small coding episode, so that a continued session needs its files, directory and environment:
    write the input, set the tool in the environment, write a check script, edit it, run it; with
    `watcher`, a process left running in the background from the first command on."""
    m = re.search(r"the string '(.*?)'", prompt)
    text = m.group(1) if m else ""
    digest = "sha-256" in prompt.lower()
    steps = [
        f"mkdir -p task && cd task && printf '%s' {shlex.quote(text)} > input.txt && "
        f"export CHECK={shlex.quote('sha256sum' if digest else 'wc -c')}"
        + (" && { sleep 3600 >/dev/null 2>&1 & }" if watcher else ""),
        "printf '%s\\n' '#!/bin/sh' 'cat input.txt | $CHECK' > check.sh && chmod 755 check.sh",
        "sed -i 's/^cat input.txt/cat -- input.txt/' check.sh",
        "./check.sh",
    ]
    if history:
        result = history[-1].result
        if _failed(result) or not isinstance(result, dict):
            return Answer(_failed(result) or "The command gave no usable output.")
    if len(history) < len(steps):
        return Call("run", {"command": steps[len(history)]})
    words = str(history[-1].result.get("output", "")).split()  # type: ignore[union-attr]
    if not words:
        return Answer("The command printed nothing.")
    if digest:
        return Answer(f"The SHA-256 digest is {words[0]}.")
    return Answer(f"The string is {words[0]} bytes long.")


# -- workplace ---------------------------------------------------------------------


def _workplace(prompt: str, history: list[Step], tools: list[dict], chance: float) -> Call | Answer:
    slip = chance < WORKPLACE_SLIP
    if m := re.search(r"Email (.+?)'s manager with the subject '(.+)'\.", prompt):
        return _email_manager(m.group(1), m.group(2), history, slip)
    if m := re.search(r"Move deal (\S+) to stage '(\w+)'\.", prompt):
        return _move_deal(m.group(1), m.group(2), history, tools, slip)
    if m := re.search(r"Book a meeting titled '(.+)' on (\d{4}-\d{2}-\d{2}) with the owner of deal (\S+?)\.", prompt):
        return _book(m.group(1), m.group(2), m.group(3), history, slip)
    if m := re.search(r"Reply to the most recent email from (.+?), using the subject 'Re: '", prompt):
        return _reply_latest(m.group(1), history, slip)
    if m := re.search(r"Send the CRM contact (.+?) an email with the subject '(.+)'\.", prompt):
        return _email_contact(m.group(1), m.group(2), history, slip)
    return Answer("I do not know how to do that with these tools.")


def _pick(result: Any, key: str, value: str) -> dict | None:
    matches = result.get("matches", []) if isinstance(result, dict) else []
    return next((r for r in matches if r.get(key) == value), None)


def _send(history: list[Step], to: str, subject: str, greeting: str) -> Call | Answer:
    sent = _find(history, "send_email")
    if sent is None:
        body = f"Hi {greeting},\n\nFollowing up on this.\n\nBest regards"
        return Call("send_email", {"to": to, "subject": subject, "body": body})
    return Answer(_failed(sent) or f"Sent '{subject}' to {to}.")


def _email_manager(name: str, subject: str, history: list[Step], slip: bool) -> Call | Answer:
    found = _find(history, "search_directory", query=name)
    if found is None:
        return Call("search_directory", {"query": name})
    person = _pick(found, "name", name)
    if person is None:
        return Answer(_failed(found) or f"I could not find {name} in the directory.")
    if slip or not person.get("manager_id"):
        # The mistake: writing to the person instead of looking up their manager.
        return _send(history, person["email"], subject, name.split()[0])
    manager_id = person["manager_id"]
    found = _find(history, "search_directory", query=manager_id)
    if found is None:
        return Call("search_directory", {"query": manager_id})
    manager = _pick(found, "person_id", manager_id)
    if manager is None:
        return Answer(_failed(found) or f"I could not find {name}'s manager.")
    return _send(history, manager["email"], subject, manager["name"].split()[0])


def _move_deal(deal_id: str, stage: str, history: list[Step], tools: list[dict], slip: bool) -> Call | Answer:
    deal = _find(history, "get_deal", deal_id=deal_id)
    if deal is None:
        return Call("get_deal", {"deal_id": deal_id})
    if _failed(deal):
        return Answer(_failed(deal) or "")
    updated = _find(history, "update_deal", deal_id=deal_id)
    if updated is not None:
        return Answer(_failed(updated) or f"Deal {deal_id} moved.")
    if slip:
        stages = _stage_enum(tools) or [stage]
        # The mistake: the stage next to the requested one in the pipeline.
        stage = stages[(stages.index(stage) + 1) % len(stages)] if stage in stages else stage
    return Call("update_deal", {"deal_id": deal_id, "stage": stage})


def _stage_enum(tools: list[dict]) -> list[str]:
    for t in tools:
        fn = t.get("function", {})
        if fn.get("name") == "update_deal":
            return list(fn.get("parameters", {}).get("properties", {}).get("stage", {}).get("enum", []))
    return []


def _book(title: str, day: str, deal_id: str, history: list[Step], slip: bool) -> Call | Answer:
    deal = _find(history, "get_deal", deal_id=deal_id)
    if deal is None:
        return Call("get_deal", {"deal_id": deal_id})
    if _failed(deal):
        return Answer(_failed(deal) or "")
    owner_id = deal["deal"]["owner_id"]
    found = _find(history, "search_directory", query=owner_id)
    if found is None:
        return Call("search_directory", {"query": owner_id})
    owner = _pick(found, "person_id", owner_id)
    if owner is None:
        return Answer(_failed(found) or f"I could not find the owner of {deal_id}.")
    created = _find(history, "create_event")
    if created is not None:
        return Answer(_failed(created) or f"Booked '{title}' on {day} with {owner['name']}.")
    if slip:
        # The mistake: the day before, as if reading the date off by one.
        day = (dt.date.fromisoformat(day) - dt.timedelta(days=1)).isoformat()
    return Call("create_event", {"title": title, "day": day, "attendees": [owner["email"]]})


def _reply_latest(name: str, history: list[Step], slip: bool) -> Call | Answer:
    inbox = _find(history, "read_inbox")
    if inbox is None:
        return Call("read_inbox", {})
    msgs = [m for m in (inbox.get("messages", []) if isinstance(inbox, dict) else []) if m.get("from_name") == name]
    if not msgs:
        return Answer(_failed(inbox) or f"There is no email from {name}.")
    ordered = sorted(msgs, key=lambda m: (m["received"], m["msg_id"]))
    # The mistake: answering the oldest thread rather than the newest.
    chosen = ordered[0] if slip else ordered[-1]
    return _send(history, chosen["from_email"], "Re: " + chosen["subject"], name.split()[0])


def _email_contact(name: str, subject: str, history: list[Step], slip: bool) -> Call | Answer:
    # Searching by last name is realistic and sometimes ambiguous, which is where the slip bites.
    query = name.split()[-1]
    found = _find(history, "lookup_contact", name=query)
    if found is None:
        return Call("lookup_contact", {"name": query})
    matches = found.get("matches", []) if isinstance(found, dict) else []
    exact = _pick(found, "name", name)
    others = [c for c in matches if c.get("name") != name]
    contact = others[0] if slip and others else exact
    if contact is None:
        return Answer(_failed(found) or f"I could not find the contact {name}.")
    return _send(history, contact["email"], subject, contact["name"].split()[0])


# -- the players, one per bundled environment --------------------------------------------------------

_MATH_PROMPT = re.compile(r"What is ([-+*\d\s()]+)\?")


@dataclass(frozen=True)
class Player:
    """One environment's scripted play: `recognizes(tool names, prompt)`, then `move(prompt, history,
    tools, seed)`; the lowest `priority` that recognises a request plays it."""

    priority: int
    recognizes: Callable[[set[str], str], bool]
    move: Callable[[str, list[Step], list[dict], int], Call | Answer]


def _math_move(prompt: str, history: list[Step], tools: list[dict], seed: int) -> Call | Answer:
    m = _MATH_PROMPT.search(prompt)
    return _math(m.group(1) if m else "", _chance(seed, prompt, "math"))


BLACKJACK = Player(10, lambda names, prompt: {"hit", "stand"} <= names, lambda prompt, h, tools, seed: _blackjack(h))
SANDBOX = Player(20, lambda names, prompt: "run" in names,
                 lambda prompt, h, tools, seed: _sandbox(prompt, h, _chance(seed, prompt, "sandbox") < SANDBOX_WATCHER))
WORKPLACE = Player(30, lambda names, prompt: bool({"send_email", "update_deal", "create_event"} & names),
                   lambda prompt, h, tools, seed: _workplace(prompt, h, tools, _chance(seed, prompt, "workplace")))
MATH = Player(40, lambda names, prompt: _MATH_PROMPT.search(prompt) is not None, _math_move)
def _python_move(prompt: str, history: list[Step], tools: list[dict], seed: int) -> Call | Answer:
    """A harness offering a Python tool and a final-answer tool (smolagents's): compute, then answer
    with what the computation printed."""
    if not history:
        m = _MATH_PROMPT.search(prompt)
        return Call("python_interpreter", {"code": f"print({m.group(1).strip() if m else 0})"})
    printed = re.findall(r"-?\d+", str((history[-1].result or {}).get("text", "")))
    return Call("final_answer", {"answer": printed[0] if printed else "no answer"})


# Before every environment's own: the harness brings its tools, whatever the task.
PYTHON_TOOL = Player(5, lambda names, prompt: {"python_interpreter", "final_answer"} <= names, _python_move)
# -- any tools, from their schemas -----------------------------------------------------

SCHEMA_CALLS = 3  # tools called per episode: enough to exercise a server's replay, few enough to stay short


def _words(prompt: str) -> str:
    quoted = re.findall(r"['\"]([^'\"]{1,80})['\"]", prompt)
    return quoted[0] if quoted else " ".join(prompt.split()[-3:]) or "x"


def schema_value(schema: Any, prompt: str) -> Any:
    """A value of JSON schema `schema` (its local `$ref`s resolved against its `$defs`), built from the
    schema and the prompt alone: what a structured-output answer or a tool's arguments hold."""
    return _value(schema, prompt, 0, _defs(schema))


def _defs(schema: Any) -> dict[str, Any]:
    """The definitions a schema's local `$ref`s name (`#/$defs/X`, `#/definitions/X`)."""
    return {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})} if isinstance(schema, dict) else {}


def _value(schema: Any, prompt: str, depth: int = 0, defs: dict[str, Any] | None = None) -> Any:
    """A value of JSON schema `schema`, built from the schema and the prompt alone: the first of an
    enum, false for a boolean, the prompt's first quoted phrase (else its last words) for a string, its first number for a
    number, one item for an array, the required fields (else the first) for an object."""
    if not isinstance(schema, dict) or depth > 6:
        return _words(prompt)
    ref = schema.get("$ref")
    if isinstance(ref, str) and defs and ref.rsplit("/", 1)[-1] in defs:
        return _value(defs[ref.rsplit("/", 1)[-1]], prompt, depth + 1, defs)
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _value(schema[key][0], prompt, depth + 1, defs)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    number = re.search(r"-?\d+(?:\.\d+)?", prompt)
    if kind == "integer":
        return int(float(number.group())) if number else 1
    if kind == "number":
        return float(number.group()) if number else 1.0
    if kind == "boolean":
        return False  # the cautious answer: a flag a judge raises usually needs others to agree
    if kind == "array":
        return [_value(schema.get("items"), prompt, depth + 1, defs)]
    if kind == "object" or "properties" in schema:
        return _arguments(schema, prompt, depth + 1, defs)
    if kind == "null":
        return None
    return _words(prompt)


def _arguments(schema: Any, prompt: str, depth: int = 0, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not properties:
        return {}
    required = [k for k in schema.get("required") or [] if k in properties] or list(properties)[:1]
    return {k: _value(properties[k], prompt, depth, defs) for k in required}


def _schema_move(prompt: str, history: list[Step], tools: list[dict], seed: int) -> Call | Answer:
    """Call each offered tool once, in the order offered (at most SCHEMA_CALLS), with arguments built
    from its parameters' schema and the prompt; then answer with what the last call returned. It
    knows no server: any server's tools are called, so a crash of any server meets recorded calls."""
    called = {step.name for step in history}
    for tool in tools:
        fn = tool.get("function") or {}
        name = fn.get("name")
        if len(history) < SCHEMA_CALLS and isinstance(name, str) and name not in called:
            return Call(name, _arguments(fn.get("parameters"), prompt, 0, _defs(fn.get("parameters"))))
    last = history[-1].result if history else None
    return Answer(_failed(last) or (json.dumps(last, sort_keys=True)[:200] if last is not None else "Done."))


_TAG_EXAMPLE = re.compile(r"<([A-Za-z_][\w-]{0,30})>([^<>\n]{1,40})</\1>")


def tagged_answer(messages: list[dict], seed: int) -> Answer | None:
    """The answer to instructions that show the reply's format as tagged examples (gymnasium-style
    servers: "reply with one of <action>Up</action>, <action>Down</action>, ..."): one of the examples
    of the first tag shown, chosen by the seed and the turn, as a model that follows the format would;
    None when the instructions show none."""
    shown = [m for msg in messages if msg.get("role") in ("system", "developer", "user")
             for m in _TAG_EXAMPLE.finditer(text_of(msg.get("content")))]
    if not shown:
        return None
    tag = shown[0].group(1)
    options = list(dict.fromkeys(m.group(2) for m in shown if m.group(1) == tag))
    turn = sum(1 for msg in messages if msg.get("role") == "assistant")
    return Answer(f"<{tag}>{options[(seed + turn) % len(options)]}</{tag}>")


# After every environment's own player: any request that offers tools.
SCHEMA = Player(900, lambda names, prompt: bool(names - {None}), _schema_move)
# The last resort: any request no other player recognises.
STRING = Player(1000, lambda names, prompt: True,
                lambda prompt, h, tools, seed: _string(prompt, _chance(seed, prompt, "string")))


# -- NeMo Gym's Workplace Assistant (its own server, relayed: participants/environments/nemo_gym_relay.py) --


def _quoted(prompt: str) -> list[str]:
    return re.findall(r"(?:^|\s)'(.+?)'(?=[\s.,!?;:]|$)", prompt)


def _gym_workplace(prompt: str, history: list[Step], tools: list[dict], seed: int) -> Call | Answer:
    """Search the mail for the first quoted phrase, reply to the named sender's latest with the second;
    without quotes, look the customers up once. A pure function of its inputs, so a replayed or resumed
    rollout plays the same moves."""
    request = prompt.split("\n\n")[-1]
    quoted = _quoted(request)
    if not quoted:  # look the people up, then stop
        names = re.findall(r"\b([A-Z][a-z]+)\b", request)[1:3]
        if len(history) < len(names):
            return Call("company_directory_find_email_address", {"name": names[len(history)]})
        return Answer("Done.")
    if not history:
        return Call("email_search_emails", {"query": quoted[0]})
    last = history[-1]
    if last.name == "email_search_emails" and len(history) == 1:
        emails = ((last.result or {}).get("output") or {}).get("emails") if isinstance(last.result, dict) else None
        if emails:
            who = re.search(r"(\w+)'s", prompt.split("\n\n")[-1])
            named = [e for e in emails if who and who.group(1).lower() in str(e.get("sender/recipient", "")).lower()]
            pick = (named or emails)[0]
            body = quoted[1] if len(quoted) > 1 else "Thanks, noted."
            return Call("email_reply_email", {"email_id": pick["email_id"], "body": body})
    return Answer("Done.")


GYM_PLAYER = Player(25, lambda names, prompt: {"email_search_emails", "email_reply_email"} <= names, _gym_workplace)
