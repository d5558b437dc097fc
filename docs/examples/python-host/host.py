"""A minimal agent host in Python on the host kit (docs/hosts.md): the kit answers every call
and keeps the protocol's promises; this file is the agent. Its turns and runs are timers:
replace `start_turn` and `start_run` with your agent's work, and call `host.settle` when a
turn ends and `host.finish` when a run is done.

    HOST_TOKEN=… BROKER_URL=redis://127.0.0.1:6379/0 python host.py

Settings (environment) as the Node example's: HOST_PORT, HOST_ID, HOST_TOKEN, HOST_STATE,
BROKER_URL (else the workers' AGENT_RADAR_BROKER_URL; their AGENT_RADAR_BROKER_KEY_PREFIX is
honoured), HOST_EFFECTS, HOST_TEST_HOOKS=1. SIGTERM stops it once the reports on their way
are sent.
"""

import os
import signal
import threading

from agent_radar.host import AgentHost, HostSession, Run, Turn, broker_reporter
from agent_radar.workflows.adapters.config import Settings


class MyAgent:
    def start_turn(self, host: AgentHost, session: HostSession, turn: Turn) -> None:
        # Your agent works on the goal or the prompt (turn.text) here; when it is done:
        ws, sid = session.workspace_id, session.session_id
        threading.Timer(0.3, host.settle, (ws, sid, turn.turn_id, "completed")).start()

    def cancel_turn(self, host: AgentHost, session: HostSession, turn: Turn) -> bool:
        # Stop the turn's work; True once it has ended (the kit settles it `canceled`), False
        # if it ends later (settle it then).
        return True

    def start_run(self, host: AgentHost, session: HostSession, run: Run) -> None:
        # Maintenance (run.kind, run.args): compact the context, then say how it went.
        ws, sid = session.workspace_id, session.session_id
        done = {"applied": True, "input_tokens": 12000, "result_tokens": 800, "summary": "ok"}
        threading.Timer(0.3, host.finish, (ws, sid, run.run_id), done).start()

    def cancel_run(self, host: AgentHost, session: HostSession, run: Run) -> None:
        host.finish(session.workspace_id, session.session_id, run.run_id, cancelled=True)


env = os.environ
broker = env.get("BROKER_URL") or env.get("AGENT_RADAR_BROKER_URL")
host = AgentHost(
    MyAgent(),
    token=env["HOST_TOKEN"],
    host_id=env.get("HOST_ID", "default"),
    state_file=env.get("HOST_STATE", "host-state.json"),
    # Published as the workers' own producers publish: their queue, key prefix, confirms.
    reporter=broker_reporter(Settings.from_env({**env, "AGENT_RADAR_BROKER_URL": broker}))
    if broker
    else None,
    effects_log=env.get("HOST_EFFECTS"),
)
server = host.serve(
    port=int(env.get("HOST_PORT", "8765")), test_hooks=env.get("HOST_TEST_HOOKS") == "1"
)


def stop(*_: object) -> None:
    host.close()  # the reports on their way go out first
    raise SystemExit(0)


signal.signal(signal.SIGTERM, stop)
print(f"listening on {server.url.rsplit(':', 1)[1]}", flush=True)
server.serve_forever()
