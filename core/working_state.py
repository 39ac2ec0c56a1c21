"""Working state (ADR-0020 decision 14): typed, bounded, written only by the control tool and the runtime.

Nothing here parses prose. Writes are all-or-nothing: a write past a cap raises and changes nothing, and no
constraint is ever evicted to make room. The state a turn sees is a fold of the writes in the session log,
with the carry rules applied at every turn boundary (docs/working-state.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.errors import WorkingStateCapError, WorkingStateError

CONTROL_TOOL_NAME = "context.update_working_state"
CAPS = {"constraints": 20, "tasks": 30, "facts": 40, "open_questions": 20}
TOKEN_CAP = 1_000

Writer = Literal["model", "runtime"]


class Constraint(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: str
    text: str


class Task(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: str
    text: str
    status: Literal["open", "in_progress", "done"] = "open"


class Fact(BaseModel):
    """An established fact. `derived_from_untrusted` keeps it out of memory formation (decision 15)."""

    model_config = ConfigDict(frozen=True)
    id: str
    text: str
    derived_from_untrusted: bool = False
    evidence: list[str] = Field(default_factory=list)


class OpenQuestion(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: str
    text: str


class WorkingState(BaseModel):
    model_config = ConfigDict(frozen=True)

    constraints: list[Constraint] = Field(default_factory=list)
    tasks: list[Task] = Field(default_factory=list)
    facts: list[Fact] = Field(default_factory=list)
    open_questions: list[OpenQuestion] = Field(default_factory=list)
    next_id: int = 1


_Text = Annotated[str, Field(min_length=1, max_length=2_000)]


class AddConstraint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["add_constraint"] = "add_constraint"
    text: _Text


class RemoveConstraint(BaseModel):
    """Runtime only (a user withdrew a constraint): the model can never drop one."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["remove_constraint"] = "remove_constraint"
    id: str


class AddTask(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["add_task"] = "add_task"
    text: _Text


class SetTaskStatus(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["set_task_status"] = "set_task_status"
    id: str
    status: Literal["open", "in_progress", "done"]


class AddFact(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["add_fact"] = "add_fact"
    text: _Text
    evidence: list[str] = Field(default_factory=list, max_length=10)


class RetractFact(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["retract_fact"] = "retract_fact"
    id: str


class AddQuestion(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["add_question"] = "add_question"
    text: _Text


class ResolveQuestion(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["resolve_question"] = "resolve_question"
    id: str


Operation = Annotated[
    AddConstraint | RemoveConstraint | AddTask | SetTaskStatus | AddFact | RetractFact | AddQuestion | ResolveQuestion,
    Field(discriminator="op"),
]


class WorkingStateUpdate(BaseModel):
    """The arguments of the control tool `context.update_working_state`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    operations: list[Operation] = Field(min_length=1, max_length=20)


class WorkingStateWrite(BaseModel):
    """One write as the session log records it: who wrote, in which turn, and whether untrusted text was in view."""

    model_config = ConfigDict(frozen=True)
    turn: int = Field(ge=0)
    writer: Writer
    untrusted_in_context: bool = False
    update: WorkingStateUpdate


def render(state: WorkingState) -> str:
    """The byte-stable text of the working state block."""
    lines = ["# Working state"]
    for title, rows in (
        ("Constraints (never dropped)", [f"- [{c.id}] {c.text}" for c in state.constraints]),
        ("Tasks", [f"- [{t.id}] ({t.status}) {t.text}" for t in state.tasks]),
        (
            "Established facts",
            [
                f"- [{f.id}]{' (from untrusted content)' if f.derived_from_untrusted else ''} {f.text}"
                for f in state.facts
            ],
        ),
        ("Open questions", [f"- [{q.id}] {q.text}" for q in state.open_questions]),
    ):
        if rows:
            lines.append(f"## {title}")
            lines.extend(rows)
    return "\n".join(lines)


def apply(
    state: WorkingState,
    update: WorkingStateUpdate,
    *,
    writer: Writer,
    count: Callable[[str], int],
    untrusted_in_context: bool = False,
    token_cap: int | None = TOKEN_CAP,
) -> WorkingState:
    """Apply every operation or none. Raises WorkingStateCapError / WorkingStateError; never evicts."""
    constraints = list(state.constraints)
    tasks = list(state.tasks)
    facts = list(state.facts)
    questions = list(state.open_questions)
    next_id = state.next_id

    def new_id(prefix: str) -> str:
        nonlocal next_id
        ident = f"{prefix}{next_id}"
        next_id += 1
        return ident

    def index_of(rows: Sequence[Constraint | Task | Fact | OpenQuestion], ident: str, field: str) -> int:
        for i, row in enumerate(rows):
            if row.id == ident:
                return i
        raise WorkingStateError(f"no {field} with id {ident!r}; the write was rejected and nothing changed")

    for op in update.operations:
        if isinstance(op, AddConstraint):
            constraints.append(Constraint(id=new_id("c"), text=op.text))
        elif isinstance(op, RemoveConstraint):
            if writer != "runtime":
                raise WorkingStateError("only the runtime may remove a constraint; the model can never drop one")
            del constraints[index_of(constraints, op.id, "constraint")]
        elif isinstance(op, AddTask):
            tasks.append(Task(id=new_id("t"), text=op.text))
        elif isinstance(op, SetTaskStatus):
            i = index_of(tasks, op.id, "task")
            tasks[i] = tasks[i].model_copy(update={"status": op.status})
        elif isinstance(op, AddFact):
            facts.append(
                Fact(
                    id=new_id("f"),
                    text=op.text,
                    derived_from_untrusted=untrusted_in_context,
                    evidence=op.evidence,
                )
            )
        elif isinstance(op, RetractFact):
            del facts[index_of(facts, op.id, "fact")]
        elif isinstance(op, AddQuestion):
            questions.append(OpenQuestion(id=new_id("q"), text=op.text))
        elif isinstance(op, ResolveQuestion):
            del questions[index_of(questions, op.id, "open question")]

    for field, rows in (
        ("constraints", constraints),
        ("tasks", tasks),
        ("facts", facts),
        ("open_questions", questions),
    ):
        if len(rows) > CAPS[field]:
            raise WorkingStateCapError(field, len(rows), CAPS[field])
    result = WorkingState(constraints=constraints, tasks=tasks, facts=facts, open_questions=questions, next_id=next_id)
    if token_cap is not None:
        tokens = count(render(result))
        if tokens > token_cap:
            raise WorkingStateCapError("working_state", tokens, token_cap, unit="tokens")
    return result


def carry(state: WorkingState) -> WorkingState:
    """The turn-boundary rule per field: constraints, facts and open questions carry; done tasks do not."""
    return state.model_copy(update={"tasks": [t for t in state.tasks if t.status != "done"]})


def fold(writes: Iterable[WorkingStateWrite], *, count: Callable[[str], int], upto_turn: int) -> WorkingState:
    """The state at the start of `upto_turn`, computed from the logged writes of earlier turns.

    Writes that were rejected were never logged, so folding cannot fail on them, and a logged write is never
    re-measured (it was accepted under the measure of its time). `carry` is idempotent, so it runs once at
    each boundary that writes cross, not once per turn.
    """
    state = WorkingState()
    turn = 0
    for write in sorted(writes, key=lambda w: w.turn):
        if write.turn >= upto_turn:
            break
        if turn < write.turn:
            state = carry(state)
            turn = write.turn
        state = apply(
            state,
            write.update,
            writer=write.writer,
            count=count,
            untrusted_in_context=write.untrusted_in_context,
            token_cap=None,
        )
    return carry(state) if turn < upto_turn else state


CONTROL_TOOL_DESCRIPTION = (
    "Update the session's working state: constraints the user set, tasks, established facts and open "
    "questions. The only way to change it; constraints can be added, never removed. A write past a cap "
    "fails and changes nothing."
)


def control_tool_schema() -> dict[str, object]:
    """JSON schema of the control tool's arguments, pinned in the prefix with the other tools."""
    return WorkingStateUpdate.model_json_schema()
