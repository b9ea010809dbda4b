from memplan.cli.main import main

main()
