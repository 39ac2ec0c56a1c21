"""The event activity: events the workflow itself decides (an epoch rotated), stored once by key beside those
the other activities record (`SessionState.event` in activities/session_state.py)."""

from __future__ import annotations

from typing import Any

from temporalio import activity

from activities.session_state import SessionState
from contract import names
from contract.activity_interfaces import EventCalls
from contract.events import EventType
from contract.payloads import EventInput


class EventActivities(EventCalls):
    def __init__(self, state: SessionState) -> None:
        self.state = state

    @activity.defn(name=names.ACTIVITY_EVENT)
    async def record_event(self, inp: EventInput) -> None:
        await self.state.event(inp.session_id, inp.event_key, EventType(inp.type), inp.turn, inp.epoch, inp.payload)

    def all(self) -> list[Any]:
        return [self.record_event]
