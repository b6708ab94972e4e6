from rlfleet.cli import main

main()
