"""The pipeline's rules, and a model of it. The rules, which the processes run: the feed's
admission (`admission`) and the region operator's lending (`lending`). The model, which
`rlfleet plan` plays: the pipeline as a discrete-event simulation (`model`), sized from a
spec, a cost profile and a split of GPUs (`sizing`), and a day of lending (`day`).
Arithmetic only, no I/O: every image and the CLI can use it."""
