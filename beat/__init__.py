# One import name (docs/packaging.md): imported as `beat` from the repository's root, this
# folder would be a second copy of every module (SQLAlchemy: "Table already defined").
if __name__ != "agent_radar.beat":
    raise ImportError(f"import agent_radar.beat, not {__name__} (docs/packaging.md)")
