from agent_radar.workflows.tools.cli import main

main()
