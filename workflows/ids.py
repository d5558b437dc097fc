"""Deterministic identifiers (docs/lifecycles.md: accept): a retry lands on the same row."""

import uuid

# The product's one namespace; changing it would orphan every stored id.
NAMESPACE = uuid.UUID("6f1c2a52-4d0e-5b7a-9c3e-a9e1d2b4c7f0")


def derive(family: str, *parts: str) -> str:
    return str(uuid.uuid5(NAMESPACE, "\0".join((family, *parts))))


def goal_operation_id(workspace_id: str, session_id: str, client_submit_id: str) -> str:
    return derive("goal", workspace_id, session_id, client_submit_id)


def lane_name(workspace_id: str, session_id: str) -> str:
    """The lease that serializes one session's goal calls (a derived id: PostgreSQL text
    cannot hold the NUL separator, and ids may contain any other printable character)."""
    return "goal-lane:" + derive("lane", workspace_id, session_id)


def delivery_name(workspace_id: str, session_id: str) -> str:
    """The lease a restore holds while it sends a session's clears and goal (maintenance
    admission waits while it is held)."""
    return "restore-delivery:" + derive("delivery", workspace_id, session_id)


def fence_id(workspace_id: str, session_id: str, client_submit_id: str) -> str:
    return derive("fence", workspace_id, session_id, client_submit_id)


FENCE_CAUSE = "goal-generation-fence:"


def fence_cause(fence: str) -> str:
    """How a fence names what it caused: the client submit ID of the clear operation it
    prepares, and the reason of a turn cancel it makes."""
    return FENCE_CAUSE + fence


def fence_clear_operation_id(workspace_id: str, session_id: str, fence: str) -> str:
    """The clear operation a fence prepares: a family of its own, so that no client submit
    ID can name (and so squat) it."""
    return derive("goal_fence_clear", workspace_id, session_id, fence)


def cancel_operation_id(workspace_id: str, session_id: str, turn_id: str) -> str:
    return derive("cancel_turn", workspace_id, session_id, turn_id)


def reused_turn_key(
    workspace_id: str, session_id: str, host_id: str, epoch: int, turn_id: str
) -> str:
    """The record key of a turn whose id an earlier turn of the session had at another host
    or epoch (workflows/sessions/turns.py)."""
    return REUSED_TURN_PREFIX + derive(
        "reused_turn", workspace_id, session_id, host_id, str(epoch), turn_id
    )


REUSED_TURN_PREFIX = "turn:"


def run_stop_id(workspace_id: str, session_id: str, run_id: str) -> str:
    """The cancel a move owes the old host for a maintenance run that ran there."""
    return derive("stop_run_at_host", workspace_id, session_id, run_id)


def maintenance_run_id(workspace_id: str, session_id: str, client_submit_id: str) -> str:
    return derive("maintenance", workspace_id, session_id, client_submit_id)


def session_stop_id(workspace_id: str, session_id: str, client_submit_id: str) -> str:
    return derive("session_stop", workspace_id, session_id, client_submit_id)


def prompt_id(workspace_id: str, session_id: str, client_submit_id: str) -> str:
    return derive("prompt", workspace_id, session_id, client_submit_id)
