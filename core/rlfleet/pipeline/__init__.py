"""The asynchronous pipeline's rules and a model of it: the feed's admission (`admission`),
which the feed runs, and the discrete-event model `rlfleet plan` plays (`model`, `sizing`).
Arithmetic only: no I/O, so any image and the CLI can use it."""
