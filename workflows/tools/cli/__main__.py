from workflows.tools.cli import main

main()
