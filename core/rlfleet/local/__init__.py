"""`rlfleet run`: one RLRun on this machine, the same components as local processes."""
