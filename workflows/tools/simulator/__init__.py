"""`agent-radar runtime-sim`: an agent host speaking the runtime protocol (docs/protocol.md).

It keeps sessions in memory, dedupes goal calls by operation id, rejects stale revisions,
records every effect it applied (`GET /sim/effects`) and every call it received
(`GET /sim/calls`), and reports through `agent_radar.report_activity`. Control endpoints
under `/sim/` take sessions offline or online, inject failures and latency, and switch a
session to acknowledging goals (`accepted`) and applying them later.
"""

from .control import SimControl
from .server import SimServer, bearer_matches
from .state import Simulator

__all__ = ["SimControl", "SimServer", "Simulator", "bearer_matches"]
