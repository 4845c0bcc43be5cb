from tpumk.cli.app import main

main()
