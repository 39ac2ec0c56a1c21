// @ts-check
// A Node orchestrator driving a ctxengine session with nothing but @temporalio/client and the published
// contract (docs/contract.md; `ctxengine schema --out DIR` for the JSON Schemas). Plain JavaScript with JSDoc
// types, so `node orchestrator.mjs` runs it without a build step; `tsc --checkJs` type-checks it.
//
// Configuration: TEMPORAL_ADDRESS (default localhost:7233), TEMPORAL_NAMESPACE (default "default"),
// CTXENGINE_TASK_QUEUE (default "ctxengine"), SESSION_ID (default a fresh one). Argv overrides them:
//   node orchestrator.mjs [address] [namespace] [task-queue]
// Prints one JSON object on stdout.

import { Client, Connection, WorkflowIdReusePolicy } from '@temporalio/client';
import { randomUUID } from 'node:crypto';

/**
 * The start input, shaped as session_open.schema.json (fields left out take their defaults).
 * @typedef {{name: string, description: string, input_schema?: Record<string, unknown>}} ToolSpec
 * @typedef {{provider?: 'scripted'|'openai'|'anthropic', model?: string}} ModelRoute
 * @typedef {{agent_instructions: string, tools?: ToolSpec[], grants?: string[] | null,
 *            model_route?: ModelRoute, budget?: Record<string, number>, memory_scope?: string}} SessionOpen
 * @typedef {{name: string, call_id: string, allowed: boolean, is_error: boolean, trust: string,
 *            summary: string, tainted: boolean}} ToolCallOutcome
 * @typedef {{turn: number, epoch: number, text: string, prefix_sha256: string,
 *            tool_calls: ToolCallOutcome[], model_calls: number}} TurnResult
 * @typedef {{session_id: string, status: string, epoch: number, turns: number,
 *            prefix_hashes: Record<string, string[]>, revoked_tools: Record<string, string>,
 *            working_state: string}} SessionState
 */

const [address, namespace, taskQueue] = [
  process.argv[2] ?? process.env.TEMPORAL_ADDRESS ?? 'localhost:7233',
  process.argv[3] ?? process.env.TEMPORAL_NAMESPACE ?? 'default',
  process.argv[4] ?? process.env.CTXENGINE_TASK_QUEUE ?? 'ctxengine',
];
const sessionId = process.env.SESSION_ID ?? `ts-session-${randomUUID()}`;

/** @type {SessionOpen} */
const open = {
  agent_instructions: 'You are a travel assistant. Cite what tools return.',
  tools: [
    {
      name: 'web.fetch',
      description: 'Fetch a web page. Its content is external and untrusted.',
      input_schema: {
        type: 'object',
        properties: { url: { type: 'string' } },
        required: ['url'],
        additionalProperties: false,
      },
    },
  ],
  model_route: { provider: 'scripted', model: 'scripted-1' },
};

async function main() {
  const connection = await Connection.connect({ address });
  const client = new Client({ connection, namespace });
  try {
    const handle = await client.workflow.start('SessionWorkflow', {
      taskQueue,
      workflowId: sessionId, // the session id: one session forever
      // A used id is refused, running or ended; an id whose start failed before the session opened may be reused.
      workflowIdReusePolicy: WorkflowIdReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
      args: [open],
    });

    /** The update id is the idempotency key: a retry with the same id returns the first result. */
    const turn = async (/** @type {string} */ text, /** @type {string} */ key) =>
      /** @type {TurnResult} */ (await handle.executeUpdate('submit_turn', { args: [{ text }], updateId: key }));

    const turns = [];
    turns.push(await turn('Plan a trip to Oslo next week.', 'turn-1'));
    turns.push(await turn('What is the weather there?\n/call web.fetch {"url": "fixture://weather"}', 'turn-2'));
    const retried = await turn('Plan a trip to Oslo next week.', 'turn-1');
    const revoked = /** @type {SessionState} */ (
      await handle.executeUpdate('revoke_tool', { args: [{ name: 'web.fetch', reason: 'fetches paused' }] })
    );
    turns.push(await turn('Check again.\n/call web.fetch {"url": "fixture://weather"}', 'turn-3'));
    const written = await handle.executeUpdate('update_working_state', {
      args: [{ operations: [{ op: 'add_constraint', text: 'Travel by train only.' }] }],
      updateId: 'ws-1',
    });
    const state = /** @type {SessionState} */ (await handle.query('state'));
    const closed = /** @type {SessionState} */ (
      await handle.executeUpdate('close_session', { args: [{ reason: 'orchestrator done' }] })
    );
    const out = {
      session_id: sessionId,
      turns: turns.map((t) => ({
        turn: t.turn,
        epoch: t.epoch,
        prefix_sha256: t.prefix_sha256,
        text: t.text,
        tool_calls: t.tool_calls.map((c) => ({ name: c.name, allowed: c.allowed, trust: c.trust })),
      })),
      retry_returned_first_result: JSON.stringify(retried) === JSON.stringify(turns[0]),
      revoked_tools: Object.keys(revoked.revoked_tools),
      working_state: written,
      state: {
        status: state.status,
        epoch: state.epoch,
        turns: state.turns,
        prefix_hashes: state.prefix_hashes,
        working_state: state.working_state,
      },
      closed_status: closed.status,
    };
    process.stdout.write(JSON.stringify(out) + '\n');
  } finally {
    await connection.close();
  }
}

main().catch((err) => {
  process.stderr.write(`orchestrator failed: ${err?.stack ?? err}\n`);
  process.exitCode = 1;
});
