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
const MAX_BODY = 1 << 20; // bytes: every call's body is a small JSON object
if (!TOKEN) {
  console.error("HOST_TOKEN is required: a host refuses calls without its token");
  process.exit(2);
}
const reports = env.BROKER_URL ? celery.createClient(env.BROKER_URL, env.BROKER_URL) : null;

// Dictionaries keyed by what callers send have no prototype: a key such as "constructor" or
// "toString" is a key like any other.
const dict = (from = {}) => Object.assign(Object.create(null), from);
const has = (d, key) => Object.prototype.hasOwnProperty.call(d, key);

// -- what survives a restart: every session's goal, revision, fences and epoch, every prompt's
// turn and run by its key, and every answer by its key (docs/protocol.md) ---------------------
const saved = fs.existsSync(STATE_FILE) ? JSON.parse(fs.readFileSync(STATE_FILE, "utf8")) : {};
const sessions = dict(); // "ws\0sid" -> session
for (const [key, s] of Object.entries(saved.sessions || {})) {
  sessions[key] = { ...s, turns: dict(), prompts: dict(s.prompts), runs: dict(s.runs) };
}
let answers = dict(saved.answers); // operation_id -> the answer it got
let turnSeq = saved.turnSeq || 0;
function save() {
  const tmp = `${STATE_FILE}.tmp`;
  const kept = Object.fromEntries(Object.entries(sessions).map(([k, s]) => [k, { ...s, turns: {} }]));
  fs.writeFileSync(tmp, JSON.stringify({ sessions: kept, answers, turnSeq }));
  fs.renameSync(tmp, STATE_FILE);
}

// A session is met at the first call that names it, live (docs/protocol.md: where sessions
// come from). Its turns belong to its process: a new epoch starts without them.
function session(ws, sid) {
  const key = `${ws}\0${sid}`;
  if (!has(sessions, key)) {
    sessions[key] = {
      ws, sid, live: true, epoch: 1, goal: null, revision: 0, applied: null,
      goalSnapshot: null, fences: [], turns: dict(), prompts: dict(), runs: dict(),
    };
  }
  return sessions[key];
}

function endRuns(s) {
  for (const run of Object.values(s.runs)) {
    if (run.state === "running") Object.assign(run, { state: "done", error: "process ended" });
  }
}

function newEpoch(s) {
  s.live = true;
  s.epoch += 1;
  s.turns = dict();
  endRuns(s);
  report(s, { session: { live: true, runtime_epoch: s.epoch } });
}

// -- one change: all of it, saved before the answer, or none of it ---------------------------
let change = null; // what the call under way did besides its state
function changing(s, fn) {
  const key = `${s.ws}\0${s.sid}`;
  const before = { s: structuredClone(s), answers: dict(answers), turnSeq };
  change = { effects: [], reports: [], starts: [] };
  try {
    const answer = fn(s);
    save();
    const done = change;
    change = null;
    for (const line of done.effects) {
      if (env.HOST_EFFECTS) fs.appendFileSync(env.HOST_EFFECTS, JSON.stringify(line) + "\n");
    }
    done.reports.forEach(send);
    done.starts.forEach((start) => start());
    return answer;
  } catch (err) {
    if (err.kept) { // a refusal that still changed the session (a run-cancel's)
      save();
      change = null;
      throw err;
    }
    sessions[key] = before.s;
    answers = before.answers;
    turnSeq = before.turnSeq;
    change = null;
    throw err;
  }
}

function effect(kind, s, fields) {
  change.effects.push({ kind, workspace_id: s.ws, session_id: s.sid, ...fields, at: Date.now() });
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
  if (fields.session) body.session = { host_id: HOST_ID, runtime_epoch: s.epoch, ...fields.session };
  if (change) change.reports.push(sign(body));
  else send(sign(body));
}

function send(signed) {
  // A report that fails is lost: the state call tells what it would have.
  try {
    reports.sendTask("agent_radar.report_activity", [], { report: signed });
  } catch (err) {
    console.error("a report could not be sent:", err.message);
  }
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
  change.starts.push(() => setTimeout(() => {
    const now = session(s.ws, s.sid);
    if (now.epoch === epoch) settle(now, turn.turn_id, "completed");
  }, TURN_MS));
  return turn;
}

function settle(s, turnId, outcome) {
  const turn = has(s.turns, turnId) ? s.turns[turnId] : null;
  if (!turn || turn.phase === "settled") return false;
  turn.phase = "settled";
  turn.outcome = outcome;
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

// -- a call's body, checked before anything changes (docs/protocol/agent-host.openapi.yaml) --
class Refusal extends Error {
  constructor(status, code, extra = {}) {
    super(code);
    Object.assign(this, { status, code, extra });
  }
}
const refuse = (detail) => new Refusal(422, "rejected", { detail });
// One thing at a time (docs/protocol.md): a run or a prompt starts on an idle session only,
// and no goal lands beside a run; a call that comes late is refused 409 busy.
function oneAtATime(s, starting) {
  const run = Object.values(s.runs).find((r) => r.state === "running");
  if (run) throw new Refusal(409, "busy", { detail: `maintenance run ${run.run_id} runs` });
  const turn = Object.values(s.turns).find((t) => t.phase !== "settled");
  if (starting !== "goal" && turn) throw new Refusal(409, "busy", { detail: `turn ${turn.turn_id} runs` });
}
function id(body, name, max = 255) {
  const v = body[name];
  if (typeof v !== "string" || v.length < 1 || v.length > max) {
    throw refuse(`${name} must be a string of 1 to ${max} characters`);
  }
  return v;
}
function whole(body, name, min = 1) {
  const v = body[name];
  if (!Number.isSafeInteger(v) || v < min) throw refuse(`${name} must be a whole number from ${min}`);
  return v;
}
const ARGS = { compact: [], summarize_up_to: ["turn"], summarize_from: ["turn"] };

const fenced = (s, op, rev) => s.fences.some(([o, r]) => o === op && r === rev);
const live = (s) => { if (!s.live) throw new Refusal(409, "disconnected"); };

// -- the calls -------------------------------------------------------------------------------
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
    const given = body.fences ?? [];
    if (!Array.isArray(given)) throw refuse("fences must be a list");
    const pairs = given.map((f) => [id(f ?? {}, "target_operation_id"), whole(f ?? {}, "target_revision")]);
    for (const [op, rev] of pairs) if (!fenced(s, op, rev)) s.fences.push([op, rev]);
    if (!s.live) {
      newEpoch(s);
      effect("resume", s, { runtime_epoch: s.epoch });
    }
    return { live: true, runtime_epoch: s.epoch };
  },

  "POST goal": (s, body) => {
    const op = id(body, "operation_id");
    const revision = whole(body, "revision");
    const action = body.action;
    if (!["set", "clear", "pause", "resume"].includes(action)) throw refuse("action");
    const objective = action === "set" ? id(body, "objective", 65536) : null;
    live(s);
    if (has(answers, op)) return answers[op];
    if (fenced(s, op, revision)) throw new Refusal(422, "rejected", { detail: "fenced" });
    if (revision <= s.revision) {
      throw new Refusal(409, "stale_revision", { current_revision: s.revision });
    }
    oneAtATime(s, "goal");
    if (action === "set") s.goal = { objective, status: "active" };
    else if (action === "clear") s.goal = null;
    else if (s.goal) s.goal = { ...s.goal, status: action === "pause" ? "paused" : "active" };
    s.revision = revision;
    s.applied = op;
    s.goalSnapshot = s.goal ? { ...s.goal } : { objective: null, status: null };
    effect("goal", s, { operation_id: op, action, revision });
    if (action === "set") {
      startTurn(s, {
        origin: "goal_continuation", source_goal_operation_id: op, source_goal_revision: revision,
      });
    }
    // The goal after the call: exactly {objective, status}, or null after a clear.
    answers[op] = { phase: "applied", goal: s.goal, evidence: { applied_revision: revision } };
    return answers[op];
  },

  "POST goal-fences": (s, body) => {
    const op = id(body, "target_operation_id");
    const rev = whole(body, "target_revision");
    if (body.require_live) live(s);
    if (!fenced(s, op, rev)) {
      s.fences.push([op, rev]);
      effect("fence", s, { target_operation_id: op, target_revision: rev });
    }
    const running = Object.values(s.turns).filter((t) => t.phase !== "settled"
      && t.source_goal_operation_id === op && t.source_goal_revision === rev);
    return { running_turns: running.map((t) => t.turn_id) };
  },

  "POST prompts": (s, body) => {
    const promptId = id(body, "prompt_id");
    id(body, "text", 65536);
    live(s);
    if (!has(s.prompts, promptId)) {
      oneAtATime(s, "prompt");
      const turn = startTurn(s, { origin: "user_prompt", prompt_id: promptId });
      s.prompts[promptId] = turn.turn_id;
      effect("prompt", s, { prompt_id: promptId, turn_id: turn.turn_id });
    }
    return { turn_id: s.prompts[promptId] };
  },

  "POST cancel": (s, body, turnId) => {
    const op = id(body, "operation_id");
    if (body.require_live) live(s);
    if (has(answers, op)) return answers[op];
    if (!has(s.turns, turnId)) throw new Refusal(404, "not_found");
    const canceled = settle(s, turnId, "canceled");
    if (canceled) effect("cancel", s, { turn_id: turnId });
    answers[op] = { result: canceled ? "canceled" : "already_settled" };
    return answers[op];
  },

  "POST maintenance": (s, body) => {
    const runId = id(body, "run_id");
    const kind = body.kind;
    const args = body.args ?? {};
    if (!has(ARGS, kind)) throw refuse(`kind must be one of ${Object.keys(ARGS)}`);
    if (typeof args !== "object" || Array.isArray(args)
      || Object.keys(args).sort().join() !== ARGS[kind].join()) throw refuse("args");
    if (has(args, "turn")) whole(args, "turn", 0);
    live(s);
    if (has(s.runs, runId) && s.runs[runId].state === "refused") {
      throw refuse("the run was cancelled before it started");
    }
    if (!has(s.runs, runId)) {
      oneAtATime(s, "run");
      const run = { run_id: runId, kind, state: "running", cancelled: false };
      s.runs[runId] = run;
      effect("maintenance", s, { run_id: runId, maintenance_kind: kind });
      change.starts.push(() => setTimeout(() => {
        const now = session(s.ws, s.sid).runs[runId];
        if (now && now.state === "running") changing(session(s.ws, s.sid), () => { now.state = "done"; });
      }, MAINTENANCE_MS));
    }
    return { state: "running" };
  },

  "GET run": (s, body, runId) => {
    if (!has(s.runs, runId) || s.runs[runId].state === "refused") throw new Refusal(404, "not_found");
    const run = s.runs[runId];
    if (run.state === "running") return { state: "running" };
    const applied = !run.cancelled && !run.error;
    return {
      state: "done", applied, cancelled: run.cancelled, error: run.error ?? null,
      input_tokens: 12000, result_tokens: applied ? 800 : null,
      summary: applied ? "conversation compacted" : null,
    };
  },

  "POST run-cancel": (s, body, runId) => {
    if (!has(s.runs, runId)) { // never started here: a start that comes late is refused
      id({ run_id: runId }, "run_id"); // within the protocol's bound, or kept nowhere
      s.runs[runId] = { run_id: runId, state: "refused" };
      throw Object.assign(new Refusal(404, "not_found"), { kept: true });
    }
    if (s.runs[runId].state === "refused") throw new Refusal(404, "not_found");
    const run = s.runs[runId];
    if (run.state === "running") Object.assign(run, { state: "done", cancelled: true });
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
// its process; both reported.
function hook(ws, sid, body) {
  return changing(session(ws, sid), (s) => {
    if (body.live === false && s.live) {
      s.live = false;
      s.turns = dict();
      endRuns(s);
      report(s, { session: { live: false } });
    }
    if (body.restart === true) newEpoch(s);
    return { live: s.live, runtime_epoch: s.epoch };
  });
}

function authorized(req) {
  const given = Buffer.from(req.headers.authorization || "");
  const expected = Buffer.from(`Bearer ${TOKEN}`);
  return given.length === expected.length && crypto.timingSafeEqual(given, expected);
}

function answer(req, body) {
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
      const [name, itemId] = parts(found);
      const call = calls[`${req.method} ${name}`];
      if (!call) break;
      const s = session(decodeURIComponent(m[1]), decodeURIComponent(m[2]));
      if (req.method === "GET") return call(s, body, itemId);
      return changing(s, (current) => call(current, body, itemId));
    }
  }
  throw new Refusal(404, "no_such_call");
}

function reply(res, status, payload) {
  const data = JSON.stringify(payload);
  res.writeHead(status, { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(data) });
  res.end(data);
}

const server = http.createServer((req, res) => {
  // The token first: nothing of a caller without it is read.
  if (!authorized(req)) {
    reply(res, 401, { error: "unauthorized" });
    req.destroy();
    return;
  }
  const chunks = [];
  let size = 0;
  req.on("data", (c) => {
    size += c.length;
    if (size > MAX_BODY) {
      reply(res, 413, { error: "rejected", detail: "a body of at most 1 MiB" });
      req.destroy();
    } else chunks.push(c);
  });
  req.on("end", () => {
    if (size > MAX_BODY) return;
    let status = 200;
    let payload;
    try {
      let body;
      try {
        body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString("utf8")) : {};
      } catch {
        throw refuse("the body is not JSON");
      }
      if (!body || typeof body !== "object" || Array.isArray(body)) throw refuse("not an object");
      payload = answer(req, body);
    } catch (err) {
      if (!(err instanceof Refusal)) console.error(err);
      status = err instanceof Refusal ? err.status : 500;
      payload = { error: err instanceof Refusal ? err.code : "server_error", ...(err.extra || {}) };
    }
    reply(res, status, payload);
  });
});

// A restart: every live session's process is new (a new epoch, reported), its goal, fences
// and keys kept; what ran in the old process ended with it. An offline one stays offline.
for (const s of Object.values(sessions)) {
  if (s.live) newEpoch(s);
  else endRuns(s);
}
save();
server.keepAliveTimeout = 30000;
server.listen(PORT, "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
