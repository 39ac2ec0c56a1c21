"""Permanent names: once deployed, renaming any of these breaks running workflows."""

TASK_QUEUE = "ctxengine"

WORKFLOW_SESSION = "SessionWorkflow"
WORKFLOW_COMPACTION = "CompactionWorkflow"
WORKFLOW_CHILD_RUN = "ChildRunWorkflow"

ACTIVITY_OPEN = "session.open"
ACTIVITY_BUILD = "context.build"
ACTIVITY_MODEL = "model.call"
ACTIVITY_TOOL = "tool.execute"
ACTIVITY_WRITE_MEMORY = "memory.write"
ACTIVITY_CLOSE = "session.close"
ACTIVITY_EVENT = "event.record"
ACTIVITY_COMPACTION_PLAN = "compaction.plan"
ACTIVITY_COMPACTION_SUMMARIZE = "compaction.summarize"
ACTIVITY_COMPACTION_COMMIT = "compaction.commit"
ACTIVITY_COMPACTION_ESCALATE = "compaction.escalate"
ACTIVITY_MEMORY_FORM = "memory.form"
ACTIVITY_WORKING_STATE_WRITE = "working_state.write"
ACTIVITY_DELETE_MEMORY = "memory.delete"
ACTIVITY_SEAL_TURN = "context.seal_turn"  # a failed turn's unanswered tool calls get error results

UPDATE_SUBMIT_TURN = "submit_turn"
UPDATE_REVOKE_TOOL = "revoke_tool"
UPDATE_ROTATE_EPOCH = "rotate_epoch"
UPDATE_WRITE_MEMORY = "write_memory"
UPDATE_CLOSE_SESSION = "close_session"
UPDATE_GRANT_TOOL = "grant_tool"
UPDATE_DELETE_MEMORY = "delete_memory"
UPDATE_WORKING_STATE = "update_working_state"
QUERY_STATE = "state"

# Search attributes shown in the Temporal UI's list (registered on the dev server by services.embedded).
SA_EPOCH = "CtxEpoch"
SA_TURNS = "CtxTurns"
SA_PREFIX_HASH = "CtxPrefixHash"
