"""The run's message bus: NATS users and their permissions (`auth`), and the run's
JetStream streams, declared once (`streams`). Below the components and the local run,
above the types of `rlfleet.api`."""
