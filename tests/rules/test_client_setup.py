"""A client pointed at a database nobody migrated (a new service's first try, a URL naming
the wrong database) gets a typed error that says what to do, and nothing is written."""

import pytest
from sqlalchemy import create_engine, inspect

from agent_radar import AgentRadar, DatabaseNotReady
from agent_radar.workflows.adapters.config import Settings
from tests.conftest import PG_ADMIN_URL


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_client_on_an_unmigrated_database_gets_database_not_ready(tmp_path, database):
    url = f"sqlite:///{tmp_path / 'empty.db'}" if database == "sqlite" else PG_ADMIN_URL
    settings = Settings.from_env({"AGENT_RADAR_HOME": str(tmp_path / "home")})
    radar = AgentRadar(url, "filesystem://", settings=settings)
    try:
        with pytest.raises(DatabaseNotReady, match="agent-radar db upgrade") as raised:
            radar.set_goal("ws", "s1", "x", client_submit_id="a")
        assert raised.value.code == "database_not_ready"
        with pytest.raises(DatabaseNotReady):
            radar.get_goal_operation("nope")
    finally:
        radar.close()
    engine = create_engine(url)
    try:
        assert "goal_operations" not in inspect(engine).get_table_names()  # nothing made
    finally:
        engine.dispose()
