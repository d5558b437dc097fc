// A minimal agent host in Node.js, written from docs/protocol.md and docs/hosts.md alone:
// every call of the protocol, its promises (idempotence by key, revisions only forward,
// fences held across restarts, require_live, epochs), and signed reports published with
// celery-node. Its "agent" is a timer: a goal set starts a turn that runs TURN_MS, a prompt
// starts one, a maintenance run takes MAINTENANCE_MS. Replace those with your agent.
//
//   npm install celery-node@0.5.9
//   HOST_TOKEN=… BROKER_URL=redis://127.0.0.1:6379/0 node host.js
//
// Settings (environment): HOST_PORT (default 8765; 0 picks one), HOST_ID (the id it was
// registered under; `default` for AGENT_RADAR_RUNTIME_URL), HOST_TOKEN (its token: the bearer
// token of every call, and the key its reports are signed with), HOST_STATE (the file that
// keeps goals, fences and answers across restarts), BROKER_URL (where reports go),
// HOST_EFFECTS (optional: a JSON-lines log of every effect), HOST_TEST_HOOKS=1 (the control
// call host-check uses, docs/host-check.md), TURN_MS, MAINTENANCE_MS.
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const http = require("http");
const celery = require("celery-node");

const env = process.env;
const PORT = Number(env.HOST_PORT ?? 8765);
const HOST_ID = env.HOST_ID || "default";
const TOKEN = env.HOST_TOKEN || "";
const STATE_FILE = env.HOST_STATE || "host-state.json";
const TURN_MS = Number(env.TURN_MS ?? 300);
const MAINTENANCE_MS = Number(env.MAINTENANCE_MS ?? 300);
const reports = env.BROKER_URL ? celery.createClient(env.BROKER_URL, env.BROKER_URL) : null;

// -- what survives a restart: every session's goal, revision, fences and epoch, and every
// answer by its key (docs/protocol.md: the goal survives a restart) ------------------------
const saved = fs.existsSync(STATE_FILE) ? JSON.parse(fs.readFileSync(STATE_FILE, "utf8")) : {};
const sessions = saved.sessions || {}; // "ws\0sid" -> session
const answers = saved.answers || {}; // operation_id -> the answer it got
let turnSeq = saved.turnSeq || 0;
function save() {
  const tmp = `${STATE_FILE}.tmp`;
  fs.writeFileSync(tmp, JSON.stringify({ sessions, answers, turnSeq }));
  fs.renameSync(tmp, STATE_FILE);
}

function effect(kind, ws, sid, fields) {
  if (env.HOST_EFFECTS) {
    const line = { kind, workspace_id: ws, session_id: sid, ...fields, at: Date.now() };
    fs.appendFileSync(env.HOST_EFFECTS, JSON.stringify(line) + "\n");
  }
}

// A session is met at the first call that names it, live (docs/protocol.md: where sessions
// come from). Its turns and runs belong to its process: a new epoch starts without them.
function session(ws, sid) {
  const key = `${ws}\0${sid}`;
  if (!sessions[key]) {
    sessions[key] = {
      ws, sid, live: true, epoch: 1, goal: null, revision: 0, applied: null,
      fences: [], turns: {}, prompts: {}, runs: {},
    };
  }
  return sessions[key];
}

function newEpoch(s) {
  s.live = true;
  s.epoch += 1;
  s.turns = {};
  s.prompts = {};
  s.runs = {};
  report(s, { session: { live: true, runtime_epoch: s.epoch } });
}

// -- reports, signed (docs/protocol.md: signing a report) ----------------------------------
const ascii = (v) => JSON.stringify(v).replace(/[\u0080-\uffff]/g,
  (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
const canon = (v) => Array.isArray(v) ? `[${v.map(canon).join(",")}]`
  : v && typeof v === "object"
    ? `{${Object.keys(v).sort().map((k) => `${ascii(k)}:${canon(v[k])}`).join(",")}}`
    : ascii(v);
function sign(body) {
  const signed = { ...body, signed_by: HOST_ID };
  const signature = crypto.createHmac("sha256", TOKEN).update(canon(signed)).digest("hex");
  return { ...signed, signature };
}

function report(s, fields) {
  if (!reports) return;
  const body = {
    workspace_id: s.ws, session_id: s.sid, occurred_at_ms: Date.now(),
    session: { host_id: HOST_ID, runtime_epoch: s.epoch }, ...fields,
  };
  if (fields.session) body.session = { host_id: HOST_ID, ...fields.session };
  reports.sendTask("agent_radar.report_activity", [], { report: sign(body) });
}

// -- turns: each one's start and end is reported (docs/hosts.md: which reports) -------------
function startTurn(s, fields) {
  turnSeq += 1;
  const turn = {
    turn_id: `turn-${HOST_ID}-${turnSeq}`, phase: "running", runtime_epoch: s.epoch,
    origin: "user_prompt", source_goal_operation_id: null, source_goal_revision: null,
    prompt_id: null, ...fields,
  };
  s.turns[turn.turn_id] = turn;
  reportTurn(s, turn);
  const epoch = s.epoch;
  setTimeout(() => s.epoch === epoch && settle(s, turn.turn_id, "completed"), TURN_MS);
  return turn;
}

function settle(s, turnId, outcome) {
  const turn = s.turns[turnId];
  if (!turn || turn.phase === "settled") return false;
  turn.phase = "settled";
  turn.outcome = outcome;
  effect("turn_settled", s.ws, s.sid, { turn_id: turnId, outcome });
  save();
  reportTurn(s, turn);
  return true;
}

function reportTurn(s, t) {
  const turn = { turn_id: t.turn_id, phase: t.phase, origin: t.origin };
  if (t.outcome) turn.outcome = t.outcome;
  if (t.source_goal_operation_id) {
    turn.source_goal_operation_id = t.source_goal_operation_id;
    turn.source_goal_revision = t.source_goal_revision;
  }
  if (t.prompt_id) turn.prompt_id = t.prompt_id;
  report(s, { turn });
}

// -- the calls -------------------------------------------------------------------------------
class Refusal extends Error {
  constructor(status, code, extra = {}) {
    super(code);
    Object.assign(this, { status, code, extra });
  }
}

const fenced = (s, op, rev) => s.fences.some(([o, r]) => o === op && r === rev);
const live = (s) => { if (!s.live) throw new Refusal(409, "disconnected"); };

function keyed(key, make) {
  // Idempotence: the same key gets the same answer, with no second effect.
  if (!(key in answers)) {
    answers[key] = make();
    save();
  }
  return answers[key];
}

const calls = {
  "GET liveness": (s) => ({ live: s.live, runtime_epoch: s.epoch }),

  "GET state": (s) => {
    const running = Object.values(s.runs).find((r) => r.state === "running");
    return {
      live: s.live,
      runtime_epoch: s.epoch,
      goal: s.applied && { operation_id: s.applied, revision: s.revision, ...s.goalSnapshot },
      fences: s.fences.map(([o, r]) => ({ target_operation_id: o, target_revision: r })),
      turns: Object.values(s.turns).filter((t) => t.phase !== "settled").map((t) => ({
        turn_id: t.turn_id, phase: t.phase, runtime_epoch: t.runtime_epoch, origin: t.origin,
        source_goal_operation_id: t.source_goal_operation_id,
        source_goal_revision: t.source_goal_revision, prompt_id: t.prompt_id,
      })),
      maintenance: running ? { run_id: running.run_id, state: "running" } : null,
    };
  },

  "POST resume": (s, body) => {
    for (const f of body.fences || []) {
      if (!fenced(s, f.target_operation_id, f.target_revision)) {
        s.fences.push([f.target_operation_id, f.target_revision]);
      }
    }
    if (!s.live) {
      newEpoch(s);
      effect("resume", s.ws, s.sid, { runtime_epoch: s.epoch });
    }
    save();
    return { live: true, runtime_epoch: s.epoch };
  },

  "POST goal": (s, body) => {
    live(s);
    if (body.operation_id in answers) return answers[body.operation_id];
    const revision = body.revision;
    if (fenced(s, body.operation_id, revision)) throw new Refusal(422, "rejected");
    if (revision <= s.revision) {
      throw new Refusal(409, "stale_revision", { current_revision: s.revision });
    }
    return keyed(body.operation_id, () => {
      if (body.action === "set") s.goal = { objective: body.objective, status: "active" };
      else if (body.action === "clear") s.goal = null;
      else if (s.goal) s.goal = { ...s.goal, status: body.action === "pause" ? "paused" : "active" };
      s.revision = revision;
      s.applied = body.operation_id;
      s.goalSnapshot = s.goal ? { ...s.goal } : { objective: null, status: null };
      effect("goal", s.ws, s.sid, {
        operation_id: body.operation_id, action: body.action, revision,
      });
      if (body.action === "set") {
        startTurn(s, {
          origin: "goal_continuation", source_goal_operation_id: body.operation_id,
          source_goal_revision: revision,
        });
      }
      // The goal after the call: exactly {objective, status}, or null after a clear.
      return { phase: "applied", goal: s.goal, evidence: { applied_revision: revision } };
    });
  },

  "POST goal-fences": (s, body) => {
    if (body.require_live) live(s);
    const op = body.target_operation_id;
    const rev = body.target_revision;
    if (!fenced(s, op, rev)) {
      s.fences.push([op, rev]);
      effect("fence", s.ws, s.sid, { target_operation_id: op, target_revision: rev });
      save();
    }
    const running = Object.values(s.turns).filter((t) => t.phase !== "settled"
      && t.source_goal_operation_id === op && t.source_goal_revision === rev);
    return { running_turns: running.map((t) => t.turn_id) };
  },

  "POST prompts": (s, body) => {
    live(s);
    if (!(body.prompt_id in s.prompts)) {
      const turn = startTurn(s, { origin: "user_prompt", prompt_id: body.prompt_id });
      s.prompts[body.prompt_id] = turn.turn_id;
      effect("prompt", s.ws, s.sid, { prompt_id: body.prompt_id, turn_id: turn.turn_id });
      save();
    }
    return { turn_id: s.prompts[body.prompt_id] };
  },

  "POST cancel": (s, body, turnId) => {
    if (body.require_live) live(s);
    if (body.operation_id in answers) return answers[body.operation_id];
    if (!(turnId in s.turns)) throw new Refusal(404, "not_found");
    return keyed(body.operation_id, () => {
      const canceled = settle(s, turnId, "canceled");
      if (canceled) effect("cancel", s.ws, s.sid, { turn_id: turnId });
      return { result: canceled ? "canceled" : "already_settled" };
    });
  },

  "POST maintenance": (s, body) => {
    live(s);
    if (!(body.run_id in s.runs)) {
      const run = { run_id: body.run_id, kind: body.kind, state: "running", cancelled: false };
      s.runs[body.run_id] = run;
      effect("maintenance", s.ws, s.sid, { run_id: body.run_id, maintenance_kind: body.kind });
      save();
      setTimeout(() => { run.state = "done"; save(); }, MAINTENANCE_MS);
    }
    return { state: "running" };
  },

  "GET run": (s, body, runId) => {
    const run = s.runs[runId];
    if (!run) throw new Refusal(404, "not_found");
    if (run.state === "running") return { state: "running" };
    const applied = !run.cancelled;
    return {
      state: "done", applied, cancelled: run.cancelled, error: null, input_tokens: 12000,
      result_tokens: applied ? 800 : null, summary: applied ? "conversation compacted" : null,
    };
  },

  "POST run-cancel": (s, body, runId) => {
    const run = s.runs[runId];
    if (!run) throw new Refusal(404, "not_found");
    if (run.state === "running") {
      run.state = "done";
      run.cancelled = true;
      save();
    }
    return {};
  },
};

const ROUTES = [
  [/^(liveness|state|resume|goal|goal-fences|prompts|maintenance)$/, (m) => [m[1]]],
  [/^turns\/([^/]+)\/cancel$/, (m) => ["cancel", decodeURIComponent(m[1])]],
  [/^maintenance\/([^/]+)$/, (m) => ["run", decodeURIComponent(m[1])]],
  [/^maintenance\/([^/]+)\/cancel$/, (m) => ["run-cancel", decodeURIComponent(m[1])]],
];
const SESSION = /^\/v1\/workspaces\/([^/]+)\/sessions\/([^/]+)\/(.+)$/;

// Test hooks (HOST_TEST_HOOKS=1, docs/host-check.md): take a session offline, or restart
// its process.
function hook(ws, sid, body) {
  const s = session(ws, sid);
  if (body.live === false && s.live) {
    s.live = false;
    report(s, { session: { live: false, runtime_epoch: s.epoch } });
  }
  if (body.restart) newEpoch(s);
  save();
  return { live: s.live, runtime_epoch: s.epoch };
}

function authorized(req) {
  const given = Buffer.from(req.headers.authorization || "");
  const expected = Buffer.from(`Bearer ${TOKEN}`);
  return given.length === expected.length && crypto.timingSafeEqual(given, expected);
}

function answer(req, body) {
  if (!authorized(req)) throw new Refusal(401, "unauthorized");
  const path = req.url.split("?")[0];
  const hookPath = path.match(/^\/sim\/sessions\/([^/]+)\/([^/]+)$/);
  if (hookPath && env.HOST_TEST_HOOKS === "1" && req.method === "POST") {
    return hook(decodeURIComponent(hookPath[1]), decodeURIComponent(hookPath[2]), body);
  }
  const m = path.match(SESSION);
  if (m) {
    for (const [pattern, parts] of ROUTES) {
      const found = m[3].match(pattern);
      if (!found) continue;
      const [name, id] = parts(found);
      const call = calls[`${req.method} ${name}`];
      if (!call) break;
      return call(session(decodeURIComponent(m[1]), decodeURIComponent(m[2])), body, id);
    }
  }
  throw new Refusal(404, "no_such_call");
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    let status = 200;
    let payload;
    try {
      const raw = Buffer.concat(chunks).toString("utf8");
      let body = {};
      try {
        body = raw ? JSON.parse(raw) : {};
      } catch {
        throw new Refusal(400, "bad_request");
      }
      payload = answer(req, body);
    } catch (err) {
      if (!(err instanceof Refusal)) console.error(err);
      status = err instanceof Refusal ? err.status : 500;
      payload = { error: err instanceof Refusal ? err.code : "server_error", ...err.extra };
    }
    const data = JSON.stringify(payload);
    res.writeHead(status, { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(data) });
    res.end(data);
  });
});

// A restart: every session's process is new (a new epoch, reported), its goal and fences
// kept; what ran in the old process ended with it.
for (const s of Object.values(sessions)) newEpoch(s);
save();
server.keepAliveTimeout = 30000;
server.listen(PORT, "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
