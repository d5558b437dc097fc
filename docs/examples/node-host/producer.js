// Every action a producer has, from Node with celery-node (docs/producers.md): a goal set, the
// same submit again, a clear, a fence, a compaction, a prompt, a session ensure and a stop,
// each followed with agent_radar.get_operation until it settles. Prints one JSON object:
// what each step's result and final record were.
//
//   node producer.js BROKER_URL RESULT_BACKEND_URL WORKSPACE SESSION
"use strict";
const celery = require("celery-node");

const [broker, backend, ws, sid] = process.argv.slice(2);
const client = celery.createClient(broker, backend);
// get(timeout, interval): poll the backend every 25 ms, not celery-node's 500.
const send = (task, kwargs) => client.createTask(task).applyAsync([], kwargs).get(60000, 25);

const SETTLED = ["completed", "failed", "superseded", "noop", "cancelled", "interrupted",
  "partially_completed"];

async function follow(id) {
  for (let i = 0; i < 600; i++) {
    const record = await send("agent_radar.get_operation", { operation_id: id, workspace_id: ws });
    if (SETTLED.includes(record.status)) return record;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${id} did not settle`);
}

const goal = (action, csid, objective) => send("agent_radar.goal_control", {
  workspace_id: ws, session_id: sid, action, client_submit_id: csid,
  ...(objective ? { objective } : {}),
});

(async () => {
  const out = {};
  const set = await goal("set", "set-1", "first goal");
  out.set = await follow(set.operation_id);
  // The same submit again: the same operation, nothing new at the host.
  out.duplicate = await goal("set", "set-1", "first goal");
  out.clear = await follow((await goal("clear", "clear-1")).operation_id);
  const shared = await goal("set", "set-2", "shared goal");
  out.shared = await follow(shared.operation_id);
  const fence = await send("agent_radar.fence_goal_generation", {
    workspace_id: ws, session_id: sid, target_operation_id: shared.operation_id,
    client_submit_id: "fence-1", reason: "binding revoked",
  });
  out.fence = await follow(fence.fence_id);
  const run = await send("agent_radar.start_maintenance", {
    workspace_id: ws, session_id: sid, kind: "compact", client_submit_id: "compact-1", args: {},
  });
  out.compaction = await follow(run.run_id);
  const prompt = await send("agent_radar.submit_prompt", {
    workspace_id: ws, session_id: sid, text: "summarize the billing module",
    client_submit_id: "prompt-1",
  });
  out.prompt = await follow(prompt.prompt_id);
  out.ensure = await send("agent_radar.ensure_session", { workspace_id: ws, session_id: sid });
  const stop = await send("agent_radar.stop_session", {
    workspace_id: ws, session_id: sid, client_submit_id: "stop-1", reason: "done for today",
  });
  out.stop = await follow(stop.stop_id);
  console.log(JSON.stringify(out));
  await client.disconnect();
  process.exit(0);
})().catch((err) => {
  console.error(err.exc_type || "", err.exc_message || "", err.stack || err);
  process.exit(1);
});
