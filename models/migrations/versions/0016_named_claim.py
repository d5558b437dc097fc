"""A named message's claim as one call (PostgreSQL; docs/dispatch.md: a named message): the
lane of the session the message names, the session's lock, then the operation's read and claim,
each a statement of its own in one function, so the claim's read starts after the lock, as a
statement of its own would. It replaces a function each connection made for itself in
`pg_temp`. Nothing on SQLite.

The claim restates the claim rule (workflows/goals/claim_rule.py) and LOOKUP_AND_CLAIM
(workflows/goals/statements.py); tests/rules/test_claim_rule.py proves all three equal, state
by state. The values of this schema's enums are frozen here; the budgets come as arguments.

Revision ID: 0016
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

NAMED_CLAIM = """
CREATE OR REPLACE FUNCTION agent_radar_named_claim(
    p_op varchar, p_ws varchar, p_sid varchar,
    p_lane varchar, p_lane_token varchar,
    p_owner varchar, p_token varchar, p_now timestamptz, p_expires timestamptz,
    p_budget_since timestamptz, p_max_attempts integer
) RETURNS TABLE (
    operation_id varchar, workspace_id varchar, session_id varchar,
    client_submit_id varchar, origin varchar, action varchar, objective text,
    goal_revision integer, status varchar, provider_phase varchar, evidence json,
    last_error text, attempt integer, next_attempt_at timestamptz,
    first_dispatched_at timestamptz, accepted_at timestamptz, completed_at timestamptz,
    created_at timestamptz, lease_owner varchar, lease_token varchar,
    lease_expires_at timestamptz, counted_as varchar,
    state_revision integer, state_pending varchar, state_sync varchar,
    held boolean, reinstall boolean,
    host_id varchar, host_url varchar, host_token varchar
) LANGUAGE plpgsql VOLATILE AS $named_claim$
#variable_conflict use_column
BEGIN
    -- The name is the message's word: nothing is written unless the operation is open and
    -- unleased in that very session.
    PERFORM 1 FROM goal_operations AS o
     WHERE o.operation_id = p_op AND o.workspace_id = p_ws AND o.session_id = p_sid
       AND o.status IN ('prepared', 'dispatched')
       AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= p_now);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- The lane: taken if free, made if new; held by another, it is theirs to drain. Made
    -- only where it has no row yet: an insert over a row another transaction is updating
    -- would wait for that one.
    UPDATE leases SET owner = p_owner, token = p_lane_token, expires_at = p_expires
     WHERE name = p_lane AND (expires_at IS NULL OR expires_at <= p_now);
    IF NOT FOUND THEN
        INSERT INTO leases (name, owner, token, expires_at)
        SELECT p_lane, p_owner, p_lane_token, p_expires
         WHERE NOT EXISTS (SELECT 1 FROM leases AS l WHERE l.name = p_lane)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    PERFORM 1 FROM agent_sessions AS s
     WHERE s.workspace_id = p_ws AND s.session_id = p_sid
       FOR UPDATE;
    -- The read and the claim, at a snapshot taken after the lock: the row as it was before
    -- the claim, returned only if the claim took it.
    RETURN QUERY
    WITH taken AS (
        UPDATE goal_operations AS o
           SET status = 'dispatched', provider_phase = 'dispatched', attempt = o.attempt + 1,
               first_dispatched_at = coalesce(o.first_dispatched_at, p_now),
               lease_owner = p_owner, lease_token = p_token, lease_expires_at = p_expires
          FROM goal_states AS g
         WHERE o.operation_id = p_op
           AND o.status IN ('prepared', 'dispatched')
           AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= p_now)
           AND g.workspace_id = o.workspace_id AND g.session_id = o.session_id
           AND g.revision = o.goal_revision AND g.pending_operation_id = o.operation_id
           AND NOT EXISTS (
               SELECT 1 FROM maintenance_runs AS m
                WHERE m.workspace_id = o.workspace_id AND m.session_id = o.session_id
                  AND m.status IN ('running', 'cancelling', 'finalizing', 'recovery_required'))
           AND o.provider_phase != 'accepted'
           AND o.attempt < p_max_attempts
           AND (o.first_dispatched_at IS NULL OR o.first_dispatched_at > p_budget_since)
        RETURNING o.operation_id, o.workspace_id, o.session_id
    ), applying AS (
        UPDATE goal_states AS g SET sync_status = 'applying'
          FROM taken AS t
         WHERE g.workspace_id = t.workspace_id AND g.session_id = t.session_id
    )
    SELECT o.operation_id, o.workspace_id, o.session_id, o.client_submit_id, o.origin,
           o.action, o.objective, o.goal_revision, o.status, o.provider_phase, o.evidence,
           o.last_error, o.attempt, o.next_attempt_at, o.first_dispatched_at,
           o.accepted_at, o.completed_at, o.created_at, o.lease_owner, o.lease_token,
           o.lease_expires_at, o.counted_as,
           g.revision, g.pending_operation_id, g.sync_status,
           EXISTS (
               SELECT 1 FROM maintenance_runs AS m
                WHERE m.workspace_id = o.workspace_id AND m.session_id = o.session_id
                  AND m.status IN ('running', 'cancelling', 'finalizing', 'recovery_required')),
           EXISTS (
               SELECT 1 FROM goal_fences AS f
                WHERE f.workspace_id = s.workspace_id AND f.session_id = s.session_id
                  AND (f.installed_host IS DISTINCT FROM s.host_id
                       OR f.installed_epoch IS DISTINCT FROM s.runtime_epoch)),
           s.host_id, h.url, h.token
      FROM goal_operations AS o
      JOIN taken AS t ON t.operation_id = o.operation_id
      JOIN agent_sessions AS s
        ON s.workspace_id = o.workspace_id AND s.session_id = o.session_id
      LEFT JOIN goal_states AS g
        ON g.workspace_id = o.workspace_id AND g.session_id = o.session_id
      LEFT JOIN runtime_hosts AS h ON h.host_id = s.host_id;
    IF NOT FOUND THEN
        -- Not claimed: the lane goes again, and nothing is left written.
        UPDATE leases SET owner = NULL, token = NULL, expires_at = NULL
         WHERE name = p_lane AND token = p_lane_token;
    END IF;
END
$named_claim$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(NAMED_CLAIM)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP FUNCTION IF EXISTS agent_radar_named_claim(varchar, varchar, varchar, "
            "varchar, varchar, varchar, varchar, timestamptz, timestamptz, timestamptz, integer)"
        )
