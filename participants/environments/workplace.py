"""An office of typed tables (email, calendar, CRM, directory) behind a handful of tools.

State is ``{"tables": {name: {"columns": [[col, type], ...], "rows": {label: {col: value}}}}}``.
Every change is an insert/update effect checked against the column types, so
a replayed log cannot smuggle in a value the tools would have refused. null and
"" are different values (unknown vs. known-empty) and both survive JSON.
"""

from __future__ import annotations

import copy
import datetime as dt
import random
from collections.abc import Callable
from typing import ClassVar

from . import players
from .base import (
    JSON,
    Environment,
    StateMode,
    Task,
    ToolError,
    ToolOutcome,
    Trajectory,
    Verification,
    function_tool,
    read_args,
)

STAGES = ["lead", "qualified", "proposal", "negotiation", "won", "lost"]
COLUMNS: dict[str, list[list[str]]] = {
    "directory": [["person_id", "str"], ["name", "str"], ["email", "str"], ["title", "str"],
                  ["manager_id", "str"], ["phone", "str"], ["start_date", "date"], ["remote", "bool"]],
    "inbox": [["msg_id", "str"], ["from_name", "str"], ["from_email", "str"], ["subject", "str"],
              ["body", "str"], ["received", "date"], ["read", "bool"]],
    "sent": [["msg_id", "str"], ["to", "str"], ["subject", "str"], ["body", "str"], ["cc", "str"]],
    "calendar": [["event_id", "str"], ["title", "str"], ["day", "date"], ["attendees", "str"], ["location", "str"]],
    "contacts": [["contact_id", "str"], ["name", "str"], ["company", "str"], ["email", "str"], ["phone", "str"]],
    "deals": [["deal_id", "str"], ["title", "str"], ["company", "str"], ["stage", "str"], ["amount", "float"],
              ["owner_id", "str"], ["contact_id", "str"], ["close_date", "date"], ["notes", "str"], ["seats", "int"]],
}
FIRST = ["Priya", "Marcus", "Elena", "Tomas", "Aisha", "Kenji", "Lucia", "Omar", "Hannah", "Diego",
         "Mei", "Samuel", "Ingrid", "Rafael", "Zara", "Felix"]
LAST = ["Shah", "Okafor", "Novak", "Lindqvist", "Haddad", "Tanaka", "Moreau", "Reyes", "Brennan", "Kowalski",
        "Adeyemi", "Castillo"]
COMPANIES = ["Northwind", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark Supply", "Wayne Freight"]
SUBJECTS = ["Q3 review", "Budget sync", "Hiring plan", "Offsite agenda", "Contract renewal", "Roadmap draft",
            "Security audit", "Launch checklist", "Pricing update", "Vendor intro"]
PREAMBLE = "You are an office assistant with email, calendar, CRM and directory tools. "


def _check_value(kind: str, value: JSON) -> bool:
    if value is None:
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, float)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "date":
        return isinstance(value, str) and _is_date(value)
    return isinstance(value, str)


def _is_date(value: str) -> bool:
    try:
        return len(value) == 10 and dt.date.fromisoformat(value).isoformat() == value
    except ValueError:
        return False


def _date_arg(value: str, key: str) -> str:
    if not _is_date(value):
        raise ToolError("bad_arguments", f"{key} must be an ISO date YYYY-MM-DD, got {value!r}")
    return value


def _table(columns: list[list[str]], rows: list[dict[str, JSON]]) -> JSON:
    key = columns[0][0]
    return {"columns": copy.deepcopy(columns), "rows": {r[key]: r for r in rows}}


def _day(rng: random.Random, start: str, span: int) -> str:
    return (dt.date.fromisoformat(start) + dt.timedelta(days=rng.randrange(span))).isoformat()


def build_tables(seed: int) -> JSON:
    rng = random.Random(seed)
    names = [f"{f} {n}" for f, n in zip(rng.sample(FIRST, 10), rng.sample(LAST, 10), strict=True)]
    people = []
    for i, name in enumerate(names):
        pid = f"p{i + 1:02d}"
        manager = None if i == 0 else ("p01" if i < 4 else f"p{rng.randint(2, 4):02d}")
        title = "CEO" if i == 0 else ("Director" if i < 4 else rng.choice(["Engineer", "Analyst", "Account Exec"]))
        people.append({
            "person_id": pid, "name": name, "email": name.lower().replace(" ", ".") + "@acme.example",
            "title": title, "manager_id": manager,
            "phone": rng.choice(["", None, f"+1-555-01{rng.randint(10, 99)}"]),
            "start_date": _day(rng, "2015-01-01", 3650), "remote": rng.random() < 0.4,
        })
    # Contacts share last names in pairs so a last-name lookup has to be disambiguated.
    last = rng.sample(LAST, 4) * 2
    contacts = []
    for i, (first, surname) in enumerate(zip(rng.sample(FIRST, 8), last, strict=True)):
        company = rng.choice(COMPANIES)
        contacts.append({
            "contact_id": f"c{i + 1:02d}", "name": f"{first} {surname}", "company": company,
            "email": f"{first.lower()}@{company.lower().replace(' ', '')}.example",
            "phone": rng.choice(["", None, f"+1-555-02{rng.randint(10, 99)}"]),
        })
    deals = []
    for i in range(8):
        contact = rng.choice(contacts)
        deals.append({
            "deal_id": f"D-{101 + i}", "title": f"{contact['company']} {rng.choice(['pilot', 'renewal', 'expansion'])}",
            "company": contact["company"], "stage": rng.choice(STAGES[:4]),
            "amount": round(rng.uniform(5_000, 90_000), 2), "owner_id": rng.choice(people[1:])["person_id"],
            "contact_id": contact["contact_id"], "close_date": _day(rng, "2026-10-01", 120),
            "notes": rng.choice(["", None, "renewal risk", "needs legal review"]), "seats": rng.randint(5, 400),
        })
    inbox = []
    for sender in rng.sample(people[1:], 3):
        for subject, day in zip(rng.sample(SUBJECTS, 3), sorted(rng.sample(range(1, 29), 3)), strict=True):
            inbox.append({
                "msg_id": "", "from_name": sender["name"], "from_email": sender["email"], "subject": subject,
                "body": f"Notes on {subject.lower()}.", "received": f"2026-11-{day:02d}", "read": rng.random() < 0.5,
            })
    for i, msg in enumerate(inbox):
        msg["msg_id"] = f"m{i + 1:02d}"
    calendar = [{
        "event_id": f"e{i + 1:02d}", "title": rng.choice(SUBJECTS), "day": _day(rng, "2026-12-01", 10),
        "attendees": ", ".join(p["email"] for p in rng.sample(people, 2)), "location": rng.choice(["", None, "Room 4"]),
    } for i in range(4)]
    return {"tables": {
        "directory": _table(COLUMNS["directory"], people), "inbox": _table(COLUMNS["inbox"], inbox),
        "sent": _table(COLUMNS["sent"], []), "calendar": _table(COLUMNS["calendar"], calendar),
        "contacts": _table(COLUMNS["contacts"], contacts), "deals": _table(COLUMNS["deals"], deals),
    }}


def make_task(seed: int) -> Task:
    rng = random.Random(f"workplace-task:{seed}")
    rows = {name: t["rows"] for name, t in build_tables(seed)["tables"].items()}
    people = rows["directory"]
    kind = rng.choice(["email_manager", "move_deal", "book_with_owner", "reply_latest", "email_contact"])
    subject = rng.choice(SUBJECTS)
    if kind == "email_manager":
        person = people[rng.choice([p for p in people if people[p]["manager_id"]])]
        goal = {"to": people[person["manager_id"]]["email"], "subject": subject}
        prompt = f"Email {person['name']}'s manager with the subject '{subject}'."
    elif kind == "move_deal":
        deal = rows["deals"][rng.choice(sorted(rows["deals"]))]
        stage = rng.choice([s for s in STAGES if s != deal["stage"]])
        goal = {"deal_id": deal["deal_id"], "stage": stage}
        prompt = f"Move deal {deal['deal_id']} to stage '{stage}'."
    elif kind == "book_with_owner":
        deal = rows["deals"][rng.choice(sorted(rows["deals"]))]
        day = _day(rng, "2026-12-01", 20)
        goal = {"title": subject, "day": day, "attendee": people[deal["owner_id"]]["email"]}
        prompt = f"Book a meeting titled '{subject}' on {day} with the owner of deal {deal['deal_id']}."
    elif kind == "reply_latest":
        sender = rng.choice(sorted({m["from_name"] for m in rows["inbox"].values()}))
        latest = max((m for m in rows["inbox"].values() if m["from_name"] == sender), key=lambda m: m["received"])
        goal = {"to": latest["from_email"], "subject": "Re: " + latest["subject"]}
        prompt = f"Reply to the most recent email from {sender}, using the subject 'Re: ' followed by that email's subject."
    else:
        contact = rows["contacts"][rng.choice(sorted(rows["contacts"]))]
        goal = {"to": contact["email"], "subject": subject}
        prompt = f"Send the CRM contact {contact['name']} an email with the subject '{subject}'."
    return Task(env="workplace", task_id="", prompt=PREAMBLE + prompt, params={"seed": seed, "kind": kind, "goal": goal})


def _matches(rows: dict[str, JSON], query: str, fields: list[str]) -> list[JSON]:
    q = query.strip().lower()
    if not q:
        raise ToolError("bad_arguments", "query must not be empty")
    return [copy.deepcopy(r) for _, r in sorted(rows.items())
            if any(isinstance(r.get(f), str) and q in r[f].lower() for f in fields)]


def _insert(table: str, rows: dict[str, JSON], prefix: str, values: dict[str, JSON]) -> ToolOutcome:
    # Labels come from the row count, so a replay assigns the same ones.
    label = f"{prefix}{len(rows) + 1:02d}"
    row = {COLUMNS[table][0][0]: label, **values}
    return ToolOutcome(output={"ok": True, "id": label}, effect={"op": "insert", "table": table, "row": label, "values": row})


class WorkplaceEnvironment(Environment):
    name: ClassVar[str] = "workplace"
    make_task = staticmethod(make_task)
    scripted = players.WORKPLACE
    state_mode: ClassVar[StateMode] = "exported"
    verification: ClassVar[Verification] = "replay"

    def tools(self) -> list[dict]:
        s, d = {"type": "string"}, {"type": "string", "format": "date"}
        return [
            function_tool("search_directory", "Find colleagues by name, id, email or title.", {"query": s}, ["query"]),
            function_tool("lookup_contact", "Find CRM contacts by name or company.", {"name": s}, ["name"]),
            function_tool("read_inbox", "List inbox messages, newest first.", {"unread_only": {"type": "boolean"}}, []),
            function_tool("send_email", "Send an email.", {"to": s, "subject": s, "body": s, "cc": s},
                          ["to", "subject", "body"]),
            function_tool("list_calendar", "List the events on one day.", {"day": d}, ["day"]),
            function_tool("create_event", "Create a calendar event.",
                          {"title": s, "day": d, "attendees": {"type": "array", "items": s}, "location": s},
                          ["title", "day", "attendees"]),
            function_tool("get_deal", "Read one CRM deal, including its owner's person_id.", {"deal_id": s}, ["deal_id"]),
            function_tool("update_deal", "Change a deal's stage, amount, seats or notes.",
                          {"deal_id": s, "stage": {"type": "string", "enum": STAGES}, "amount": {"type": "number"},
                           "seats": {"type": "integer"}, "notes": s}, ["deal_id"]),
        ]

    def initial_state(self, task: Task) -> JSON:
        return build_tables(int(task.params["seed"]))

    def call_tool(self, state: JSON, name: str, arguments: dict) -> ToolOutcome:
        rows = {t: v["rows"] for t, v in state["tables"].items()}
        tool = _TOOLS.get(name)
        if tool is None:
            raise ToolError("unknown_tool", f"no tool named {name!r}")
        return tool(rows, arguments)

    @staticmethod
    def _deal(rows: dict[str, JSON], deal_id: str) -> JSON:
        if deal_id not in rows["deals"]:
            raise ToolError("not_found", f"no deal {deal_id!r}")
        return rows["deals"][deal_id]

    def apply(self, state: JSON, effect: JSON) -> JSON:
        try:
            op, table, label, values = effect["op"], effect["table"], effect["row"], effect["values"]
            columns = dict(map(tuple, state["tables"][table]["columns"]))
        except (KeyError, TypeError) as exc:
            raise ToolError("bad_effect", f"malformed effect: {effect!r}") from exc
        if not isinstance(values, dict):
            raise ToolError("bad_effect", "effect values must be an object")
        rows = state["tables"][table]["rows"]
        if op not in ("insert", "update") or (op == "insert") == (label in rows):
            raise ToolError("bad_effect", f"cannot {op} row {label!r} of {table}")
        if op == "insert" and set(values) != set(columns):
            raise ToolError("bad_effect", f"an insert into {table} must set every column")
        for col, value in values.items():
            if col not in columns or not _check_value(columns[col], value):
                raise ToolError("bad_effect", f"{table}.{col} cannot hold {value!r}")
        new_state = copy.deepcopy(state)
        new_rows = new_state["tables"][table]["rows"]
        new_rows[label] = {**new_rows.get(label, {}), **copy.deepcopy(values)}
        return new_state

    def verify(self, task: Task, state: JSON, trajectory: Trajectory) -> float:
        goal, kind = task.params["goal"], task.params["kind"]
        rows = {t: v["rows"] for t, v in state["tables"].items()}
        if kind == "move_deal":
            ok = rows["deals"].get(goal["deal_id"], {}).get("stage") == goal["stage"]
        elif kind == "book_with_owner":
            ok = any(e["title"] == goal["title"] and e["day"] == goal["day"]
                     and goal["attendee"] in [x.strip() for x in (e["attendees"] or "").split(",")]
                     for e in rows["calendar"].values())
        else:
            ok = any(m["to"] == goal["to"] and m["subject"] == goal["subject"] for m in rows["sent"].values())
        return 1.0 if ok else 0.0


# ---- the tools: each reads its arguments, checks them and says what it changes ----------------------


def _search_directory(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"query": ("str", True)})
    found = _matches(rows["directory"], a["query"], ["name", "email", "title"])
    found += [copy.deepcopy(r) for r in rows["directory"].values() if r["person_id"] == a["query"].strip()]
    return ToolOutcome(output={"matches": found}, effect=None)


def _lookup_contact(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"name": ("str", True)})
    return ToolOutcome(output={"matches": _matches(rows["contacts"], a["name"], ["name", "company"])}, effect=None)


def _read_inbox(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"unread_only": ("bool", False)})
    msgs = [m for m in rows["inbox"].values() if not (a.get("unread_only") and m["read"])]
    msgs.sort(key=lambda m: (m["received"], m["msg_id"]), reverse=True)
    return ToolOutcome(output={"messages": copy.deepcopy(msgs)}, effect=None)


def _send_email(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"to": ("str", True), "subject": ("str", True), "body": ("str", True),
                              "cc": ("str", False)})
    if "@" not in a["to"]:
        raise ToolError("bad_arguments", f"not an email address: {a['to']!r}")
    # An omitted cc stays null; an explicit "" is kept as "", the two mean different things.
    values = {"to": a["to"], "subject": a["subject"], "body": a["body"], "cc": a.get("cc")}
    return _insert("sent", rows["sent"], "s", values)


def _list_calendar(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    day = _date_arg(read_args(arguments, {"day": ("str", True)})["day"], "day")
    events = [copy.deepcopy(e) for _, e in sorted(rows["calendar"].items()) if e["day"] == day]
    return ToolOutcome(output={"day": day, "events": events}, effect=None)


def _create_event(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"title": ("str", True), "day": ("str", True), "attendees": ("list[str]", True),
                              "location": ("str", False)})
    values = {"title": a["title"], "day": _date_arg(a["day"], "day"),
              "attendees": ", ".join(a["attendees"]), "location": a.get("location")}
    return _insert("calendar", rows["calendar"], "e", values)


def _get_deal(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    deal_id = read_args(arguments, {"deal_id": ("str", True)})["deal_id"]
    return ToolOutcome(output={"deal": copy.deepcopy(WorkplaceEnvironment._deal(rows, deal_id))}, effect=None)


def _update_deal(rows: dict[str, JSON], arguments: dict) -> ToolOutcome:
    a = read_args(arguments, {"deal_id": ("str", True), "stage": ("str", False), "amount": ("float", False),
                              "seats": ("int", False), "notes": ("str", False)})
    WorkplaceEnvironment._deal(rows, a["deal_id"])
    if "stage" in a and a["stage"] not in STAGES:
        raise ToolError("bad_arguments", f"stage must be one of {STAGES}")
    values = {k: v for k, v in a.items() if k != "deal_id"}
    if not values:
        raise ToolError("bad_arguments", "nothing to update")
    return ToolOutcome(output={"ok": True, "deal_id": a["deal_id"], "updated": sorted(values)},
                       effect={"op": "update", "table": "deals", "row": a["deal_id"], "values": values})


_TOOLS: dict[str, Callable[[dict[str, JSON], dict], ToolOutcome]] = {
    "search_directory": _search_directory,
    "lookup_contact": _lookup_contact,
    "read_inbox": _read_inbox,
    "send_email": _send_email,
    "list_calendar": _list_calendar,
    "create_event": _create_event,
    "get_deal": _get_deal,
    "update_deal": _update_deal,
}
