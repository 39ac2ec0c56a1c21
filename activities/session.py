"""`SessionActivities`: every session activity family over one shared `SessionState`, what worker.py builds
and registers.

One family per concern: the session's life (`lifecycle.py`), the build (`build.py`), the model call
(`model_call.py`), tool calls (`tool_calls.py`), runtime writes (`memory.py`) and events (`events.py`). Each
family class is a slot of this aggregate, as is the state they share, so the harness injects a fault by
subclassing it and putting a subclass of one family (or of the state) in that slot (harness/faults.py);
production code never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from activities.build import BuildActivities
from activities.events import EventActivities
from activities.lifecycle import LifecycleActivities
from activities.memory import MemoryActivities
from activities.model_call import ModelCallActivities
from activities.provider import ModelProvider
from activities.session_state import SessionState
from activities.store import Store
from activities.tool_calls import ToolCallActivities
from activities.tools import Executor


class SessionActivities:
    state_class: ClassVar[type[SessionState]] = SessionState
    lifecycle_family: ClassVar[type[LifecycleActivities]] = LifecycleActivities
    build_family: ClassVar[type[BuildActivities]] = BuildActivities
    model_call_family: ClassVar[type[ModelCallActivities]] = ModelCallActivities
    tool_call_family: ClassVar[type[ToolCallActivities]] = ToolCallActivities
    memory_family: ClassVar[type[MemoryActivities]] = MemoryActivities
    event_family: ClassVar[type[EventActivities]] = EventActivities

    def __init__(
        self,
        store: Store,
        providers: dict[str, ModelProvider],
        *,
        search_attributes: bool = False,
        max_sessions_cached: int = 512,
        executors: Mapping[str, Executor] | None = None,
        scripted_by_default: bool = False,
    ) -> None:
        self.state = self.state_class(
            store,
            providers,
            search_attributes=search_attributes,
            max_sessions_cached=max_sessions_cached,
            scripted_by_default=scripted_by_default,
        )
        self.lifecycle = self.lifecycle_family(self.state)
        self.build = self.build_family(self.state)
        self.model_call = self.model_call_family(self.state)
        self.tool_calls = self.tool_call_family(self.state, executors)
        self.memory = self.memory_family(self.state)
        self.events = self.event_family(self.state)

    def all(self) -> list[Any]:
        """Every session activity, bound to its family: what the worker registers."""
        return [
            *self.lifecycle.all(),
            *self.build.all(),
            *self.model_call.all(),
            *self.tool_calls.all(),
            *self.memory.all(),
            *self.events.all(),
        ]
